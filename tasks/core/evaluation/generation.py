"""The generation check: greedy replies of the exported model to held-out prompts, through its chat
template and its own generation config, and whether they stop at an end-of-turn token.

    python -c "from pathlib import Path; from tasks.core.evaluation.generation import generation_check; \
import json; recs = [json.loads(l) for l in open('runs/tiny-demo/data/sft/heldout.jsonl')]; \
print(generation_check(Path('runs/tiny-demo/export'), recs, 'messages', 16, 2)[0])"

Its concerns: which token closes an assistant turn (`end_of_turn_id`, found as the SFT labels find
it), whether generation_config.json's eos_token_id holds it (`generation_eos_problem`), which
prompts to ask (the first distinct ones of the held-out set), and the replies themselves, the
model loaded and placed as the held-out loss loads it (`tasks.core.evaluation.heldout`) and released
before this returns. The gate reads the summary (`tasks.core.evaluation.verdict`, `stop_problem`).
"""

from __future__ import annotations

import json
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tasks.core.config.schema import EvalConfig
from tasks.core.data.samples import render_chat, special_token_ids
from tasks.core.evaluation import placement as where
from tasks.core.evaluation.heldout import eval_device, input_device, load_model, load_tokenizer, resolved
from tasks.core.evaluation.release import release
from tasks.core.run import meter


def end_of_turn_id(tokenizer) -> int | None:
    """The token the chat template closes an assistant turn with (<|im_end|>, <|eot_id|>, ...).

    Found the way `encode_chat` labels it: the last special token between the generation prompt
    and the end of a rendered one-turn reply.
    """
    msgs = [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong"}]
    prompt = render_chat(tokenizer, msgs[:1], add_generation_prompt=True)
    turn = render_chat(tokenizer, msgs, add_generation_prompt=False)
    special = special_token_ids(tokenizer)
    for j in range(len(turn) - 1, len(prompt) - 1, -1):
        if turn[j] in special:
            return int(turn[j])
    return tokenizer.eos_token_id


def prompt_messages(messages: list[dict]) -> list[dict] | None:
    """The conversation up to and including its last user turn (None if it has none)."""
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    return None if last_user is None else list(messages[: last_user + 1])


def distinct_prompts(heldout: Sequence[dict], messages_field: str, n: int) -> list[list[dict]]:
    """The first n distinct prompts of the held-out records, in file order."""
    seen, out = set(), []
    for rec in heldout:
        p = prompt_messages(rec.get(messages_field) or []) if isinstance(rec, dict) else None
        key = json.dumps(p, sort_keys=True)
        if p and key not in seen:
            seen.add(key)
            out.append(p)
        if len(out) == n:
            break
    return out


def _eos_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def generation_eos_problem(model_dir: Path, tokenizer) -> tuple[list[int], int | None, str | None]:
    """(eos ids of generation_config.json, end-of-turn id, problem or None)."""
    eot = end_of_turn_id(tokenizer)
    token = tokenizer.convert_ids_to_tokens(eot) if eot is not None else None
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return (
            [],
            eot,
            (
                f"{path.name} is missing: generation would not know to stop at the chat template's end-of-turn token "
                f"{token!r} (id {eot}); "
                "set export.align_stop_tokens: true so the export writes one whose eos_token_id includes it"
            ),
        )
    eos = _eos_ids(json.loads(path.read_text()).get("eos_token_id"))
    if eot is not None and eot not in eos:
        return (
            eos,
            eot,
            (
                f"generation_config.json eos_token_id {eos} lacks the chat template's end-of-turn token {token!r} (id "
                f"{eot}): "
                "generation would run past the end of a reply; set export.align_stop_tokens: true (the default) so "
                "the export adds it, "
                f"or add {eot} to eos_token_id"
            ),
        )
    return eos, eot, None


def generation_check(
    model_dir: Path,
    heldout: Sequence[dict],
    messages_field: str,
    max_new_tokens: int,
    num_prompts: int,
    dtype: str | None = None,
    trust_remote_code: bool = False,
) -> tuple[dict[str, Any], list[dict]]:
    """Greedy replies to held-out prompts through the chat template, with the model's own
    generation config (as a user of the export gets it), placed as the held-out loss places it.
    Returns (summary, one row per prompt)."""
    import torch

    with torch.no_grad():
        return _generation_check(
            model_dir, heldout, messages_field, max_new_tokens, num_prompts, dtype, trust_remote_code
        )


def stop_problem(stopped: int, prompts: int, max_new_tokens: int) -> str:
    """The generation check's problem when some greedy generations ran to max_new_tokens (the gate's
    message states it once, `tasks.core.evaluation.verdict`)."""
    return (
        f"{prompts - stopped} of {prompts} greedy generations did not stop at an eos token within "
        f"max_new_tokens={max_new_tokens}"
    )


def _generation_check(
    model_dir: Path,
    heldout: Sequence[dict],
    messages_field: str,
    max_new_tokens: int,
    num_prompts: int,
    dtype: str | None,
    trust_remote_code: bool,
) -> tuple[dict[str, Any], list[dict]]:
    import torch

    started = time.monotonic()
    dtype = resolved(EvalConfig(dtype=dtype)).dtype
    tokenizer = load_tokenizer(model_dir, trust_remote_code)
    eos, eot, eos_problem = generation_eos_problem(model_dir, tokenizer)
    prompts = distinct_prompts(heldout, messages_field, num_prompts)
    if not prompts:
        raise ValueError(f"no held-out SFT record has a user turn to prompt with ({len(heldout)} records)")
    placed = where.place(
        model_dir,
        dtype,
        max(len(render_chat(tokenizer, p, add_generation_prompt=True)) for p in prompts) + max_new_tokens,
    )
    model = load_model(model_dir, dtype, eval_device(), trust_remote_code, placed)
    device = input_device(model, eval_device())
    stop_ids = set(_eos_ids(model.generation_config.eos_token_id))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (min(stop_ids) if stop_ids else 0)
    rows = []
    progress = meter.meter(f"greedy generations of {'/'.join(Path(model_dir).parts[-2:])}", len(prompts), "prompts")
    try:
        for i, msgs in enumerate(prompts):
            ids = torch.tensor([render_chat(tokenizer, msgs, add_generation_prompt=True)], device=device)
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=pad,
            )
            new = out[0, ids.shape[1] :].tolist()
            stopped = bool(new) and new[-1] in stop_ids
            rows.append(
                {
                    "prompt": msgs,
                    "completion": tokenizer.decode(new, skip_special_tokens=False),
                    "new_tokens": len(new),
                    "stopped": stopped,
                    "stop_token": tokenizer.convert_ids_to_tokens(new[-1]) if stopped else None,
                }
            )
            progress.add()
    finally:
        progress.finish()
        gone = weakref.ref(model)
        del model
        release(gone)
    stopped = sum(r["stopped"] for r in rows)
    problems = [eos_problem] if eos_problem else []
    if stopped < len(rows):
        problems.append(stop_problem(stopped, len(rows), max_new_tokens))
    summary = {
        "passed": not problems,
        "problems": problems,
        "prompts": len(rows),
        "stopped": stopped,
        "max_new_tokens": max_new_tokens,
        "mean_new_tokens": sum(r["new_tokens"] for r in rows) / len(rows),
        "eos_token_id": eos,
        "end_of_turn": {"id": eot, "token": tokenizer.convert_ids_to_tokens(eot) if eot is not None else None},
        "dtype": dtype,
        "device": placed.describe(),
        "seconds": round(time.monotonic() - started, 3),
    }
    return summary, rows
