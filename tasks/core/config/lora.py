"""A LoRA adapter's settings (`<phase>.lora`), the targets every supported family names alike.

    python -c "from tasks.core.config.lora import LoraConfig; print(LoraConfig().targets_text())"

Which phases accept it is their registry row's (`tasks.core.config.phases.PhaseSpec.lora_refused`), which plugins
the plugin row's (`PluginSpec.lora`); the engine applies it in `tasks.engine.lora`.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field

from tasks.core.config.base import Frozen

# The linear projections of every supported family (tasks/core/models/families.py: llama, mistral,
# qwen2, qwen3 name them alike); LoRA on all of them is the QLoRA paper's finding for quality.
LORA_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _target_regex(value: str) -> str:
    """A string target_modules is 'all-linear' or a regex peft matches with re.fullmatch."""
    if value.lower() != "all-linear":
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(
                f"{value!r} is neither 'all-linear' nor a valid regex ({exc}); write a list of module names, e.g. "
                "[q_proj, v_proj]"
            ) from None
    return value


class LoraConfig(Frozen):
    """A LoRA adapter trained on the frozen base (peft's LoraConfig, through booster.enable_lora)."""

    r: int = Field(
        default=8, ge=1, description="Rank of each adapter's low-rank update (B @ A, A: r x in, B: out x r)."
    )
    alpha: float = Field(
        default=16.0,
        gt=0,
        description="Scale of the update: the adapter adds (alpha / r) * B @ A to each targeted weight.",
    )
    dropout: float = Field(
        default=0.0,
        ge=0.0,
        lt=1.0,
        description="Dropout on the adapter's input (peft lora_dropout); 0 keeps a resumed run bitwise.",
    )
    target_modules: Annotated[str, AfterValidator(_target_regex)] | Annotated[tuple[str, ...], Field(min_length=1)] = (
        Field(
            default=LORA_TARGETS,
            description=(
                "The modules that get an adapter, in peft's forms: a list of names, each matching a module whose name "
                "ends in it "
                "(default every attention and MLP projection); 'all-linear', every linear module but the LM head; or "
                "any other "
                "string, a regex that must match a module's whole name. Pre-flight refuses a target that adapts "
                "nothing."
            ),
        )
    )
    modules_to_save: tuple[str, ...] = Field(
        default=(),
        description=(
            "Modules trained in full beside the adapters and saved with them (peft modules_to_save), e.g. ['lm_head'] "
            "after adding tokens; empty: every base weight stays frozen."
        ),
    )
    quantize: bool = Field(
        default=False,
        description=(
            "QLoRA: load the frozen base in 4-bit NF4 (bitsandbytes, through booster.enable_lora(quantize=True)); "
            "needs CUDA "
            "and bitsandbytes."
        ),
    )

    def targets_text(self) -> str:
        """target_modules for a log line or a card: the names, 'all-linear', or the regex quoted."""
        t = self.target_modules
        return (t if t.lower() == "all-linear" else f"regex {t!r}") if isinstance(t, str) else ", ".join(t)
