"""fp32 master weights in every checkpoint of a mixed-precision stage, and their exact restore.

    python -c "from tasks.engine.masters import collect; help(collect)"

ColossalAI 0.5.0 saves the working weights (bf16/fp16) and the optimizer's moments, never the
fp32 masters the optimizer steps: LowLevelZero's flat master shards (and HybridParallel's ZeRO-1,
the same optimizer over the dp group), HybridParallel's MixedPrecisionOptimizer masters (ZeRO
off), Gemini's fp32 chunks. On load every plugin rebuilds them from the working weights
(`update_master_params`, Gemini's `paired_chunk.payload.copy_`), so a resumed bf16 run loses
every update below bf16's resolution and drifts from the uninterrupted one.

Here each rank writes what it holds, as it holds it: `masters/rank-NNNNN.safetensors` (its fp32
pieces, flat, padding included, a tensor at a time) and `masters/rank-NNNNN.json` (where each
piece sits in the whole parameter: `tasks.core.models.convert.state_view.Piece`). A rank of a
data-parallel replica without ZeRO records its pieces but writes none: dp rank 0 holds the same.
The JSON is written under fp32 too (no masters): it names every parameter's optimizer id, which
the layout-neutral view (`CheckpointState`) needs to read ColossalAI's optimizer files by name.

Restore, after ColossalAI rebuilt the masters: a piece with the same coordinates in the checkpoint
is read as it was written; any other is cut from the whole master (`local_piece`'s bytes, read by
`CheckpointState.read_piece` straight from the source's pieces where they are flat, without the
whole tensor), so a new layout gets the same fp32 values. fp16's dynamic loss scale (its scale and the two counters
ColossalAI's own state_dict leaves out) is saved and restored beside them.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tasks.core.models.convert.dtypes import TORCH_TO_ST
from tasks.core.models.convert.state_view import (
    MASTERS,
    CheckpointState,
    Piece,
    rank_record_name,
    rank_tensor_name,
)
from tasks.core.models.convert.write import safetensors_header
from tasks.engine import state_read

__all__ = ["DUMP_ENV", "Local", "collect", "dump_loaded", "restore", "save"]

# For the tests of the layout-neutral view and of a resume under a new layout: each rank also writes
# the state it holds at a save and right after a load, as it holds it (its pieces, the live masters,
# weights and AdamW's local state), to $DUMP_ENV/<step>/rank-N.pt and $DUMP_ENV/loaded-<step>/.
DUMP_ENV = "CPT_TO_SFT_STATE_DUMP"


@dataclass
class Local:
    """One parameter on this rank: its piece record, the fp32 master tensor (None: the weight is
    the master), and the tensor AdamW's state is keyed by."""

    piece: Piece
    master: torch.Tensor | None
    state_key: torch.Tensor
    working: torch.Tensor | None = None
    param: torch.Tensor | None = None  # the optimizer's tensor for it (AdamW's state is keyed by it after a load)
    state_piece: Piece | None = None  # the part of the whole parameter `param` (and its AdamW state) covers


def _maps(opt) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    w2m = getattr(opt, "get_working_to_master_map", lambda: None)() or {}
    m2w = getattr(opt, "get_master_to_working_map", lambda: None)() or {}
    return w2m, m2w


def collect(eng) -> list[Local]:
    """Every trained parameter this rank holds, with its piece of the whole and its fp32 master."""
    opt, model = eng.optimizer, eng.model.unwrap()
    inner = getattr(opt, "optim", opt)
    if hasattr(opt, "param_to_chunk16"):
        return _gemini(eng, opt, model)
    params = dict(model.named_parameters())
    names = {id(p): n for n, p in params.items()}
    w2m, m2w = _maps(opt)
    info = getattr(opt, "param_info", None)
    held = [q for g in inner.param_groups for q in g["params"]]
    order = [id(m2w.get(id(q), q)) for q in held]
    tp_size = getattr(eng.plugin, "tp_size", 1) if eng.spec.supports_tp_pp else 1
    tp_rank = dist.get_rank(eng.plugin.tp_group) if tp_size > 1 else 0
    replica = eng.layout.dp_rank + eng.layout.sp_rank  # 0: the first copy of a replicated piece
    out: list[Local] = []
    for pos, wid in enumerate(order):
        name = names.get(wid)
        if name is None:
            continue
        working = params[name]
        pid = info["param2id"][wid] if info else pos
        shape = tuple(info["param2shape"][wid]) if info else tuple(working.shape)
        local = tuple(working.shape)
        tp_dim = next((d for d, (a, b) in enumerate(zip(shape, local)) if a > b), None)
        master = w2m.get(wid)
        if master is not None and (
            master is working or master.dtype != torch.float32 or working.dtype == torch.float32
        ):
            master = None  # fp32 training: the weight is its own master
        start, length, sharded = 0, math.prod(local), False
        if master is not None and hasattr(opt, "param_to_pg"):  # ZeRO: an equal flat share of the padded slice
            from colossalai.zero.low_level._utils import get_nd_rank, get_nd_world_size

            pg = opt.param_to_pg[working]
            length, sharded = master.numel(), get_nd_world_size(pg) > 1
            start = get_nd_rank(pg) * length
        split = tp_dim is not None and tp_size > 1  # else every tp rank holds the same (a norm): tp rank 0 writes it
        piece = Piece(
            name,
            pid,
            shape,
            local,
            tp_dim if split else None,
            tp_rank if split else 0,
            tp_size if split else 1,
            start,
            length,
            saved=master is not None and (sharded or replica == 0) and (split or tp_rank == 0),
            rank=eng.rank,
        )
        out.append(
            Local(
                piece,
                master,
                master if master is not None and master in inner.state else working,
                working,
                held[pos],
                _state_piece(opt, piece, held[pos], working),
            )
        )
    return out


def _state_piece(opt, piece: Piece, param: torch.Tensor, working: torch.Tensor) -> Piece:
    """What the optimizer's tensor for a parameter covers: the working slice itself, a ZeRO flat share
    of it (padded; also under fp32, where the weight is its own master), or a whole fp32 master slice."""
    if param is working:
        return replace(piece, start=0, length=piece.local_numel)
    if hasattr(opt, "param_to_pg") and working in opt.param_to_pg:
        from colossalai.zero.low_level._utils import get_nd_rank

        return replace(piece, start=get_nd_rank(opt.param_to_pg[working]) * param.numel(), length=param.numel())
    return replace(piece, start=0, length=param.numel())


def _gemini(eng, opt, model) -> list[Local]:
    """Gemini (CUDA only): each fake parameter of the optimizer stands for a range of its real
    parameter's fp32 chunk that this rank updates."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for pid, fake in opt.id_to_fake_params.items():
        real = opt.id_to_real_params[pid]
        chunk = opt.param_to_chunk16[fake]
        begin, end = opt.param_to_range[fake]
        info = chunk.tensors_info[real]
        start = begin + (0 if chunk.keep_gathered else chunk.shard_begin) - info.offset
        master = chunk.paired_chunk.payload[begin:end] if getattr(opt.module, "master_weights", True) else None
        shape = tuple(real.shape)
        name = names.get(id(real)) or opt.module.param2name.get(real, f"param.{pid}")
        piece = Piece(name, pid, shape, shape, None, 0, 1, start, end - begin, saved=master is not None, rank=eng.rank)
        out.append(Local(piece, master, fake))
    return out


def _scaler(opt):
    """fp16's DynamicGradScaler (LowLevelZero's mixin, MixedPrecisionOptimizer's), else None."""
    for attr in ("mixed_precision_mixin", "mixed_precision"):
        scaler = getattr(getattr(opt, attr, None), "grad_scaler", None)
        if scaler is not None:
            return scaler
    return None


def save(eng, out: Path) -> dict[str, Any]:
    """Write this rank's record and fp32 pieces under `out` (every rank); the manifest's summary."""
    out.mkdir(parents=True, exist_ok=True)
    locals_ = collect(eng)
    saved = [loc for loc in locals_ if loc.piece.saved]
    record: dict[str, Any] = {
        "rank": eng.rank,
        "world_size": eng.world,
        "plugin": eng.pcfg.name,
        "params": [loc.piece.record() for loc in locals_],
    }
    scaler = _scaler(eng.optimizer)
    if scaler is not None:
        record["loss_scale"] = {
            "scale": float(scaler.scale.item()),
            "growth_step": scaler._growth_step,
            "hysteresis_step": scaler._hysteresis_step,
        }
    if saved:
        _write(out / rank_tensor_name(eng.rank), [(loc.piece.name, loc.master) for loc in saved])
    (out / rank_record_name(eng.rank)).write_text(json.dumps(record))
    if os.environ.get(DUMP_ENV):
        _dump(eng, locals_, Path(os.environ[DUMP_ENV]) / out.parent.name.strip(".").removesuffix(".tmp"))
    counts = torch.tensor([len(saved), sum(loc.piece.length for loc in saved)], dtype=torch.float64, device=eng.device)
    dist.all_reduce(counts)  # on the device: NCCL reduces device tensors only
    return {"fp32": bool(counts[0] > 0), "pieces": int(counts[0]), "bytes": int(counts[1]) * 4}


def dump_loaded(eng, ckpt: Path) -> None:
    """With DUMP_ENV set: the state this rank resumes from, to $DUMP_ENV/loaded-<step>/rank-N.pt."""
    if os.environ.get(DUMP_ENV):
        _dump(eng, collect(eng), Path(os.environ[DUMP_ENV]) / f"loaded-{ckpt.name}")


def _dump(eng, locals_: list[Local], where: Path) -> None:
    inner = getattr(eng.optimizer, "optim", eng.optimizer)
    where.mkdir(parents=True, exist_ok=True)
    dump = {}
    for loc in locals_:
        # .get: indexing the optimizer's state (a defaultdict) would add an entry for a tensor outside
        # its param_groups (LowLevelZero fp32 keys state by the flat master), and break its next state_dict()
        state = {
            k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
            for k, v in inner.state.get(loc.state_key, {}).items()
        }
        dump[loc.piece.name] = {
            "piece": loc.piece.record(),
            "master": None if loc.master is None else loc.master.detach().cpu().clone(),
            "weight": None if loc.working is None else loc.working.detach().cpu().clone(),
            **state,
        }
    torch.save(dump, where / f"rank-{eng.rank:05d}.pt")


def _write(path: Path, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """A safetensors file of flat fp32 tensors, written a tensor at a time (no whole-file buffer)."""
    header = safetensors_header([(n, TORCH_TO_ST[torch.float32], (t.numel(),), t.numel() * 4) for n, t in tensors])
    with open(path, "wb") as f:
        f.write(header)
        for _, t in tensors:
            flat = t.detach().reshape(-1)
            if flat.device.type != "cpu":
                flat = flat.cpu()
            f.write(memoryview(flat.contiguous().numpy()).cast("B"))
        f.flush()
        os.fsync(f.fileno())


@torch.no_grad()
def restore(eng, ckpt: Path, held: list[Local] | None = None, view: CheckpointState | None = None) -> str:
    """Overwrite the masters ColossalAI rebuilt from the working weights with the checkpoint's (and,
    where this plugin trains fp32 weights but the checkpoint's weights were bf16/fp16 beside fp32
    masters, those weights with the masters); a sentence for the log, or "" when there was nothing to do.
    `held` and `view`: `collect(eng)` and the checkpoint's view where the caller has them (it closes it)."""
    held = collect(eng) if held is None else held
    own = view is None
    records = (ckpt / MASTERS).is_dir() and any((ckpt / MASTERS).glob("rank-*.json"))
    view = (CheckpointState(ckpt) if records else None) if own else view
    with_masters = view is not None and view.has_masters
    targets = [(loc, loc.master) for loc in held if loc.master is not None]
    if with_masters:  # e.g. torch_ddp bf16 (fp32 weights under autocast) continuing a low_level_zero bf16 stage
        targets += [
            (loc, loc.working)
            for loc in held
            if loc.master is None and loc.working is not None and loc.working.dtype == torch.float32
        ]
    if not targets:
        return ""
    if not with_masters and (view is None or view.weights_dtype(targets[0][0].piece.name) != torch.float32):
        return (
            f"{ckpt.name} holds no fp32 master weights (written before they were saved): rebuilt from the "
            f"{eng.weights_dtype} working weights, so this resume is not exact"
        )
    direct = cut = 0
    reads = []
    for loc, dst in targets:
        p = loc.piece
        same = next(
            (
                q
                for q in view.pieces(p.name)
                if q.saved
                and (q.tp_rank, q.tp_size, q.start, q.length, q.local_shape)
                == (p.tp_rank, p.tp_size, p.start, p.length, p.local_shape)
            ),
            None,
        )
        if same is not None:  # written by a rank in this rank's place: its bytes, padding included
            reads.append(state_read.Read(dst, p.length, lambda buf, q=same: view._read_piece(q, buf)))
            direct += 1
        else:  # another layout (or fp32 weights of a checkpoint without masters): cut from the whole
            reads.append(state_read.Read(dst, p.length, lambda buf, p=p: view.read_piece(p.name, "master", p, buf)))
            view.extents(p.name, "master")  # found here, before the threads share the view
            cut += 1
    state_read.run(reads)
    rec = json.loads((ckpt / MASTERS / rank_record_name(min(eng.rank, len(view.ranks) - 1))).read_text())
    scaler = _scaler(eng.optimizer)
    if scaler is not None and "loss_scale" in rec:
        ls = rec["loss_scale"]
        scaler._scale = torch.tensor([ls["scale"]], dtype=torch.float32, device=scaler.scale.device)
        scaler._growth_step, scaler._hysteresis_step = ls["growth_step"], ls["hysteresis_step"]
    if own:
        view.close()
    how = ", ".join(
        x
        for x in (
            f"{direct} as written" if direct else "",
            f"{cut} cut from the whole tensors for this layout" if cut else "",
        )
        if x
    )
    what = (
        "fp32 master weights"
        if any(loc.master is not None for loc, _ in targets)
        else "fp32 weights from the fp32 master weights"
    )
    return f"restored the {what} of {ckpt.name} ({how}) instead of rebuilding them from the {eng.weights_dtype} weights"
