"""Pre-flight: what each training stage will do with the checkpoints already under the run root.

    python -m flows.cpt_to_sft --config my.yaml --check     # one line per stage with checkpoints

A stage whose newest committed checkpoint was made from the same config digest continues it, under
the layout the config now asks for (its model and optimizer re-sharded by the loaders): said in one
line, naming both layouts. A new layout that changes the global batch is refused, naming the
values that keep it, when nothing else the model learns from changed (the digest at the
checkpoint's global batch is the checkpoint's). Any other change moves the checkpoints aside, as the
training task does (tasks/stages/train.py `_supersede_foreign`); said too. Parents' content digests come
from their artifacts on the run root; without them (nothing built yet) there is nothing to say.
"""

from __future__ import annotations

from typing import Any

from tasks.core.config.elastic import FIELD, kept_accumulation
from tasks.core.config.layout import global_batch
from tasks.core.config.sequence import sp_factor, sp_size
from tasks.core.preflight.report import CheckContext
from tasks.core.run.digest import config_digest, content_digest
from tasks.core.run.segments import describe, global_batch_problem, record, same_layout
from tasks.core.run.stages import GLOBAL_BATCH, STAGE, STAGES, STEP_RE, TRAINING

__all__ = ["check_resume"]


def _layout_now(phase_cfg) -> dict[str, Any]:
    p = phase_cfg.plugin
    world = phase_cfg.launch.world_size
    sp = {"sp": {"mode": p.sequence_parallelism.mode, "size": sp_size(p)}} if p.sequence_parallelism else {}
    return record(
        {"name": p.name, "tp": p.tp_size, "pp": p.pp_size, "zero": p.zero_stage, **sp},
        world,
        max(1, world // (p.tp_size * p.pp_size * sp_factor(p))),
        phase_cfg.micro_batch_size,
        phase_cfg.grad_accum_steps,
    )


def check_resume(ctx: CheckContext) -> None:
    from tasks.core.storage.fs import RunStore

    try:
        store = RunStore(ctx.cfg.run_uri, staging_dir=ctx.cfg.staging_dir)
    except (ValueError, ImportError):
        return  # check_run_root says why
    for key in TRAINING:
        # an optional phase this run leaves out (dpo) has no checkpoints to resume, nor a row where it has no stages
        shard = next((s for s in STAGES if s.global_batch == key), None)
        if shard is None or getattr(ctx.cfg, key) is None:
            continue
        try:
            steps = sorted(((int(m.group(1)), n) for n in store.listdir(key) if (m := STEP_RE.match(n))), reverse=True)
        except OSError:  # an unreadable run root: check_run_root says why
            return
        newest = None
        for _, name in steps:
            try:
                newest = (name, store.read_manifest(f"{key}/{name}"))
                break
            except Exception:  # noqa: S112 - no manifest: not committed, the engine discards it
                continue
        if newest is None:
            continue
        try:
            parents = {p: content_digest(store.read_manifest(STAGE[p].artifact)) for p in shard.parents}
        except Exception:  # noqa: S112 - a parent not built (or not whole): it is rebuilt and the stage with it
            continue
        name, manifest = newest
        phase_cfg = getattr(ctx.cfg, key)
        was, now = (manifest.get("meta") or {}).get("layout"), _layout_now(phase_cfg)
        digest = manifest.get("config_digest")
        if digest == config_digest(ctx.cfg, shard.name, parents):
            if was and phase_cfg.elastic.keep_global_batch and now["global_batch"] != was["global_batch"]:
                ga = kept_accumulation(was["global_batch"], now["micro_batch_size"], now["dp"])
                if ga is None:
                    ctx.problem(
                        f"{key}.{FIELD}", f"{store.uri(key)}/{name}: {global_batch_problem(was['global_batch'], now)}"
                    )
                    continue
                now = {**now, "grad_accum_steps": ga, "global_batch": was["global_batch"]}
                ctx.ok(
                    f"{key}: {FIELD} sets grad_accum_steps to {ga}: the global batch of {name} ({was['global_batch']})"
                )
            if was and not same_layout(was, now):
                ctx.ok(
                    f"{key}: resuming {name}, written under {describe(was)}, under {describe(now)}: model and "
                    "optimizer re-sharded"
                )
            else:
                ctx.ok(f"{key}: resuming {name} under the layout that wrote it")
        elif (
            was
            and global_batch(phase_cfg) != was["global_batch"]
            and digest
            == config_digest(ctx.cfg, shard.name, parents, fields={f"{key}.{GLOBAL_BATCH}": was["global_batch"]})
        ):
            field = f"{key}.grad_accum_steps"
            ctx.problem(field, f"{store.uri(key)}/{name}: {global_batch_problem(was['global_batch'], now)}")
        else:
            ctx.ok(
                f"{key}: what the model learns from changed since {name} (data, lr, schedule, seed, precision, LoRA, "
                "packing "
                f"or a parent): its checkpoints will be moved aside and the stage trained from step 0"
            )
