"""Pre-flight's estimates under LoRA: only the trainable parameters carry gradients and optimizer state.

.venv/bin/python -m pytest -q tests/test_estimates.py
"""

from __future__ import annotations

from tasks.core.config.schema import PhaseConfig
from tasks.core.preflight.memory import GB, estimate

# SmolLM2-135M's config.json (30 layers, 9 heads, 3 KV heads, tied embeddings): 134.5M parameters.
SMOL = {
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "tie_word_embeddings": True,
    "max_position_embeddings": 8192,
}


def _sft(lora: dict | None, gpu_gb: float) -> PhaseConfig:
    return PhaseConfig.model_validate(
        {
            "data": {"uri": "x"},
            "plugin": {"name": "low_level_zero", "zero_stage": 2, "precision": "bf16"},
            "max_steps": 1,
            "lr": 1e-4,
            "seq_len": 512,
            "micro_batch_size": 1,
            "launch": {"nproc_per_node": 1, "gpu_memory_gb": gpu_gb},
            "lora": lora,
        }
    )


def test_lora_counts_gradients_and_optimizer_state_of_the_adapter_only():
    full = estimate(SMOL, _sft(None, 4.0), phase="sft", cuda=True)
    lora = estimate(SMOL, _sft({"r": 8}, 4.0), phase="sft", cuda=True)
    assert 134e6 < full.parameters < 135e6 and lora.parameters == full.parameters
    # A 4 GB GPU: full fine-tuning (fp32 master, gradient shard and moments of every parameter:
    # 4.69 GB with the CUDA reserve) is refused; LoRA's adapter (r 8 on every attention and MLP
    # projection: 2.4M parameters) adds tens of MB to the frozen bf16 base: 3.09 GB, it fits. The
    # old estimate counted the state of all 134.5M parameters under LoRA too, and refused it.
    assert full.device > 4.0 * GB > lora.device, (full.breakdown(), lora.breakdown())
    adapter = 8 * 30 * ((576 + 576) + (576 + 192) * 2 + (576 + 576) + (576 + 1536) * 3)
    by = {t.what: t.bytes for t in lora.terms}
    assert by["Adam moment shard"] == adapter * 8 and by["fp32 master weight shard"] == adapter * 4, by
    assert by["working weights"] == full.parameters * 2  # the frozen base is still there, in bf16
