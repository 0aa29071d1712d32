"""What a run produces, as config sections: the export (`export:`), the gate before the push (`gate:`) and
the Hub repo it goes to (`hub:`). `tasks.core.config.schema.RunConfig` holds them.

    python -c "from tasks.core.config.outputs import GateConfig; print(GateConfig())"
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tasks.core.config.base import Frozen
from tasks.core.config.benchmark import GateBenchmarkFields


class ExportConfig(Frozen):
    dtype: Literal["fp32", "bf16", "fp16"] = Field(default="bf16", description="dtype of the exported safetensors.")
    max_shard_size: str = Field(
        default="5GB", description="Largest safetensors shard of the export, e.g. '5GB' or '500MB'."
    )
    fingerprint_rtol: float | None = Field(
        default=None,
        gt=0,
        description=(
            "Logits sanity check after the bitwise weight proof: allowed max |logit difference| against the SFT "
            "fingerprint, relative to max |logit| "
            "(top-1 must also agree wherever the reference's margin exceeds it); default 1e-5 for fp32, 0.04 for "
            "bf16, 0.005 for fp16."
        ),
    )
    align_stop_tokens: bool = Field(
        default=True,
        description=(
            "Make generation_config.json eos_token_id a list: the base model's eos plus the chat template's "
            "end-of-turn token(s), found by rendering "
            "a conversation; pad_token_id set from the tokenizer. false keeps the base model's generation config as "
            "it is."
        ),
    )


class GateConfig(GateBenchmarkFields):  # benchmarks: the limits on the benchmark stage's scores
    enabled: bool = Field(
        default=True,
        description=(
            "Check the thresholds below before push_to_hub; a failed gate skips the push and keeps every artifact. "
            "false lets every run through (metrics are still computed and recorded)."
        ),
    )
    cpt_max_ppl_increase_pct: float | dict[str, float] | None = Field(
        default=0.0,
        description=(
            "Fail when the CPT model's held-out perplexity is more than this many percent above the base model's "
            "(0: must not get worse; negative: must improve by at least that much); null: not checked. A mapping "
            "{source: percent} (a cpt.data.sources mixture) checks each source's own held-out perplexity instead, e.g. "
            "{general: 5.0}: the replayed general text may get at most 5 % worse, every source not named must not get "
            "worse."
        ),
    )
    sft_loss_must_improve: bool = Field(
        default=True,
        description="Fail unless the SFT model's held-out loss on assistant tokens is below the pre-SFT (CPT) model's.",
    )
    generation_must_stop: bool = Field(
        default=True,
        description=(
            "Fail unless the export's generation_config.json eos_token_id includes the chat template's end-of-turn "
            "token "
            "and every greedy generation of a held-out prompt ends at an eos token within max_new_tokens."
        ),
    )
    # The dpo phase's limits (checked only in a run with a `dpo:` section; evaluate_dpo's figures on held-out pairs).
    dpo_min_accuracy: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description=(
            "DPO: fail unless the DPO model's held-out preference accuracy (the share of pairs whose chosen reply "
            "gets the higher implicit reward) is at least this; null: not checked."
        ),
    )
    dpo_min_margin: float | None = Field(
        default=0.0,
        description=(
            "DPO: fail unless the DPO model's mean held-out reward margin (beta times the log-ratio gap between the "
            "chosen and the rejected reply, against the SFT model) is above this; 0: DPO must prefer the chosen "
            "replies more than SFT did; null: not checked."
        ),
    )
    dpo_max_chosen_logp_drop: float | None = Field(
        default=None,
        ge=0,
        description=(
            "DPO: fail when the DPO model's mean log-likelihood of the held-out chosen replies, per token, is more "
            "than this many nats below the SFT model's (a run can widen the margin by making good answers less "
            "likely too); null: not checked."
        ),
    )
    max_new_tokens: int = Field(
        default=256, ge=1, description="Generation check: the most tokens a reply may take before it must have stopped."
    )
    num_prompts: int = Field(
        default=4,
        ge=1,
        description="Generation check: how many held-out SFT prompts (messages up to the last user turn) are decoded "
        "greedily.",
    )


class HubConfig(Frozen):
    repo_id: str = Field(
        description="Target Hub repo, 'org/name' in ASCII letters, digits, '-', '_', '.' (pre-flight names a look-alike)."
    )
    private: bool = Field(default=True, description="Create the repo private.")
    revision: str = Field(default="main", description="Branch to commit to (created if missing).")
    commit_message: str = Field(default="cpt-to-sft export", description="Commit message of the single export commit.")
    license: str | None = Field(
        default=None,
        description=(
            "License id for the model card metadata: one the Hub lists (https://huggingface.co/docs/hub/"
            "repositories-licenses), e.g. 'apache-2.0', or 'other'; pre-flight refuses any other value."
        ),
    )
    tags: tuple[str, ...] = Field(
        default=(),
        description="Extra model card tags: at most 50, each 1 to 64 ASCII letters, digits and '-_.:+/' (pre-flight).",
    )
    push_provenance: bool = Field(
        default=True,
        description=(
            "Also upload the export's provenance (.cpt-to-sft/: manifest, verification record, fingerprint) in its "
            "subfolder; false pushes only the model files and the card."
        ),
    )
    push_adapter: bool = Field(
        default=False,
        description=(
            "With sft.lora (dpo.lora in a run with dpo): also push export-adapter/ (the adapter alone, peft's layout) "
            "to hub.adapter_repo_id, or, when that is unset, to the "
            "subfolder adapter/ of hub.repo_id in the same commit; never beside the merged weights. Its "
            "base_model_name_or_path is the run's "
            "cpt/hf (sft/hf for dpo; a local reference: that model is not pushed)."
        ),
    )
    adapter_repo_id: str | None = Field(
        default=None,
        description=(
            "Hub repo ('org/name', not hub.repo_id) the adapter goes to with hub.push_adapter; unset: the subfolder "
            "adapter/ of hub.repo_id."
        ),
    )
