"""Which of ColossalAI 0.5.0's shardformer policies for decoder families run with the installed transformers.

    torchrun --standalone --nproc-per-node 2 benchmarks/shardformer_policies.py            # every family
    torchrun --standalone --nproc-per-node 2 benchmarks/shardformer_policies.py gpt2 opt   # some
    torchrun --standalone --nproc-per-node 2 benchmarks/shardformer_policies.py --smoke    # the policy rows
    torchrun --standalone --nproc-per-node 2 benchmarks/shardformer_policies.py falcon@pp2 # pp=2, tp=1

`<family>@pp2` runs the same check at pp=2 through the 1F1B schedule (`execute_pipeline`). Run one
family per launch there: a stage that raises leaves the other waiting on its point-to-point receive,
which the process-group timeout does not bound.

For each causal-LM class that ColossalAI's `auto_policy` maps to a policy (the remote-code ones,
`transformers_modules.*`, are left out: the project never runs code from a model folder), a tiny
random fp32 model of the family goes through HybridParallelPlugin at tp=2 on 2 gloo ranks (CPU,
`tasks.engine.cpu_compat`, as the engine runs): boost, forward with labels, backward, one optimizer
step, a second forward. It works when every step finishes, the sharded forward's loss equals the
unsharded model's (same weights, same batch) within 1e-4, and the loss after the step is finite.
Otherwise the first failure is reported with where it was raised. One JSON line per family
(`@@policy {...}`), from rank 0; the results are written down in benchmarks/results/ and the
rows of tasks/core/models/policy_rows.py. `--smoke` measures the families with a row there and
exits 1 when one disagrees with its row (a policy refused there that trains, or one claimed that fails).

A failure is deterministic and the same on both ranks (a policy that does not fit the installed
model's modules fails while sharding, before any collective), so the loop goes on to the next
family; a process-group timeout of 120 s bounds a rank that waits on one that raised.
"""

from __future__ import annotations

import json
import math
import os
import sys
import traceback
from datetime import timedelta

import _checkout  # noqa: F401 - first: the checkout on sys.path (support/ is not installed)

VOCAB, SEQ, BATCH = 512, 16, 2
# tiny configs: hidden 64, 4 heads (2 per tp rank), 2 layers, no dropout (the sharded and unsharded
# losses are compared in training mode); config class name -> fields
TINY: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2)),
    "mistral": ("MistralConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2)),
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                attn_pdrop=0.0)),
    "gptj": ("GPTJConfig", dict(n_embd=64, n_layer=2, n_head=4, n_positions=64, rotary_dim=8)),
    "opt": ("OPTConfig", dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                              max_position_embeddings=64, word_embed_proj_dim=64, dropout=0.0)),
    "bloom": ("BloomConfig", dict(hidden_size=64, n_layer=2, n_head=4)),
    "falcon": ("FalconConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4)),
    "falcon_new_arch": ("FalconConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                             new_decoder_architecture=True, num_kv_heads=2)),
    "mixtral": ("MixtralConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                      num_experts_per_tok=2)),
    "cohere": ("CohereConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2)),
}  # fmt: skip
# the same families again with what their failure above points at: OPT's policy knows eager and
# flash_attention_2 only (transformers 4.51 builds sdpa by default); Cohere's attention forward
# switches shardformer's flash attention on and asserts the mask that only the flag's model forward makes
VARIANTS: dict[str, tuple[str, dict, dict]] = {
    "opt+eager": ("opt", {"attn_implementation": "eager"}, {}),
    "cohere+flash_attention": ("cohere", {}, {"enable_flash_attention": True}),
}


def where(exc: BaseException) -> str:
    """The innermost frame of the traceback inside ColossalAI or transformers: file (from the package) and line."""
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        for pkg in ("colossalai/", "transformers/", "torch/"):
            if pkg in frame.filename:
                return f"{pkg}{frame.filename.split(pkg, 1)[1]}:{frame.lineno} ({frame.name})"
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


def probe(name: str) -> dict:
    import torch
    import transformers
    from colossalai.booster import Booster
    from colossalai.booster.plugin import HybridParallelPlugin
    from transformers import AutoModelForCausalLM

    name, _, layout = name.partition("@")  # "falcon@pp2": pipeline parallelism instead of tp
    base, model_kw, plugin_kw = VARIANTS.get(name, (name, {}, {}))
    pp = layout == "pp2"
    cls, fields = TINY[base]
    config = getattr(transformers, cls)(vocab_size=VOCAB, **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32, **model_kw)
    out: dict = {"family": name + ("@pp2" if pp else ""), "class": type(model).__name__}
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, VOCAB, (BATCH, SEQ), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    with torch.no_grad():
        ref = model(**batch).loss.item()
    stage = "boost"
    try:
        layout_kw = (
            dict(tp_size=1, pp_size=2, num_microbatches=2, pp_style="1f1b") if pp else dict(tp_size=2, pp_size=1)
        )
        plugin = HybridParallelPlugin(
            **layout_kw, zero_stage=0, precision="fp32", overlap_communication=False,
            enable_all_optimization=False, make_vocab_size_divisible_by=1, **plugin_kw,
        )  # fmt: skip
        booster = Booster(plugin=plugin)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optim, *_ = booster.boost(model, optim)
        if pp:  # forward and backward in one 1F1B schedule; the loss on the last stage, sent to every rank
            stage = "pipeline forward/backward"
            res = booster.execute_pipeline(iter([batch]), model, lambda o, _: o.loss, optim, return_loss=True)
            last = plugin.stage_manager.is_last_stage()
            loss = torch.tensor([res["loss"].item() if last else 0.0])
            torch.distributed.all_reduce(loss)
            out["loss"], out["ref_loss"] = loss.item(), ref
            stage = "step"
            optim.step()
            optim.zero_grad()
            stage = "second pipeline forward"
            with torch.no_grad():
                res = booster.execute_pipeline(iter([batch]), model, lambda o, _: o.loss, None, return_loss=True)
            after_t = torch.tensor([res["loss"].item() if last else 0.0])
            torch.distributed.all_reduce(after_t)
            after = after_t.item()
        else:
            stage = "forward"
            loss = model(**batch).loss
            out["loss"], out["ref_loss"] = loss.item(), ref
            stage = "backward"
            booster.backward(loss, optim)
            stage = "step"
            optim.step()
            optim.zero_grad()
            stage = "second forward"
            with torch.no_grad():
                after = model(**batch).loss.item()
        out["loss_after_step"] = after
        ok = abs(out["loss"] - ref) <= 1e-4 and math.isfinite(after)
        out["works"] = ok
        if not ok:
            out["failure"] = f"tp=2 loss {out['loss']:.6f} vs unsharded {ref:.6f}, after a step {after}"
    except Exception as exc:
        out["works"] = False
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        out["failure"] = f"{stage}: {type(exc).__name__}: {first} at {where(exc)}"
    return out


def main() -> int:
    import torch
    import torch.distributed as dist

    from tasks.engine import cpu_compat
    from tasks.engine.lazy_compile import import_colossalai

    import_colossalai()
    if not torch.cuda.is_available():
        cpu_compat.apply()
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    from tasks.core.models.policy_rows import POLICY_ROWS

    args = sys.argv[1:]
    # --smoke: the families with a policy row, each measured against what its row claims
    names = sorted(POLICY_ROWS) if args == ["--smoke"] else args or [*TINY, *VARIANTS]
    wrong = []
    for name in names:
        result = probe(name)
        row = POLICY_ROWS.get(name)
        if row is not None and result["works"] == bool(row.policy_refused):
            wrong.append(
                f"{name}: measured works={result['works']}, its row says policy_refused={row.policy_refused!r}"
            )
        if int(os.environ.get("RANK", "0")) == 0:
            print("@@policy " + json.dumps(result), flush=True)
    dist.destroy_process_group()
    if wrong and int(os.environ.get("RANK", "0")) == 0:
        print("rows of tasks/core/models/policy_rows.py that disagree with the measurement:\n" + "\n".join(wrong))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
