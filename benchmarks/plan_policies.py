"""The derived tensor-parallel policy measured against the unsharded model: run by shardformer_policies.py.

    torchrun --standalone --nproc-per-node 2 benchmarks/shardformer_policies.py --plan     # every family
    torchrun --standalone --nproc-per-node 2 benchmarks/shardformer_policies.py --time llama  # step time, both policies
    torchrun --standalone --nproc-per-node 3 benchmarks/shardformer_policies.py --smollm2 4 8  # SmolLM2's shape, tp=3

`plan_probe` puts a tiny random fp32 model of a family through HybridParallelPlugin at tp=2 with
`tasks.engine.plan_policy.PlanPolicy` (its row of `tasks.core.models.tp_plan.PLAN_ROWS`) and the same model
unsharded through plain SGD (AdamW's eps turns gradient noise of 1e-7 into moves of 0.1-0.2 relative on
near-zero weights, even in one process), and compares two steps' losses, every parameter's gradient after
the first (each rank's shard gathered along its split dim), the weights after the steps as saved at tp=2
and converted by the project's converter, and a lazily built model's forward (LazyInitContext, as the
engine builds it), then a save and resume at tp=2 that must redo the step after the save bitwise
(`plan_resume`). `shardformer_policies.py --smoke` runs it for every plan row, Llama and `PLAN_VARIANTS` in
its one launch, so the suite pays the imports once. `smollm2_cpt` trains SmolLM2-135M's shape at tp=3 under
both policies (`--smollm2`).
"""

from __future__ import annotations

import copy
import math
import os
import time
import traceback

import _checkout  # noqa: F401 - first: the checkout on sys.path (support/ is not installed)

VOCAB, SEQ, BATCH = 512, 16, 2
# a pipeline's loss is compared in training mode (execute_pipeline): its dropout off
DROPOUT_FIELDS = (
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "dropout",
    "attention_dropout",
    "hidden_dropout",
    "activation_dropout",
)


def where(exc: BaseException) -> str:
    """The innermost frame of the traceback inside ColossalAI or transformers: file (from the package) and line."""
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        for pkg in ("colossalai/", "transformers/", "torch/"):
            if pkg in frame.filename:
                return f"{pkg}{frame.filename.split(pkg, 1)[1]}:{frame.lineno} ({frame.name})"
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


_DENSE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)  # GQA: 2 query heads per KV head, one KV head per tp rank
# the families the derived policy is measured on (PLAN_ROWS, and the three with ColossalAI's own policy, for the
# comparison); config class name -> fields. Gemma 3 and Gemma 2 tie their head by default, OLMo does not.
PLAN_TINY: dict[str, tuple[str, dict]] = {
    "qwen3": ("Qwen3Config", dict(_DENSE, head_dim=16)),
    "gemma3_text": ("Gemma3TextConfig", dict(_DENSE, head_dim=16, sliding_window=8, sliding_window_pattern=2)),
    "phi3": ("Phi3Config", dict(_DENSE, pad_token_id=None)),
    "olmo2": ("Olmo2Config", dict(_DENSE)),
    "gemma2": ("Gemma2Config", dict(_DENSE, head_dim=16, sliding_window=8)),
    "granite": ("GraniteConfig", dict(_DENSE)),
    "olmo": ("OlmoConfig", dict(_DENSE)),
    "helium": ("HeliumConfig", dict(_DENSE, head_dim=16)),
    "starcoder2": ("Starcoder2Config", dict(_DENSE, sliding_window=None)),
    # families only later transformers build (their rows' min_transformers): SmolLM3 with a NoPE layer (layer 1
    # skips the rotary embedding; its config's pad_token_id 128004 is beyond the vocabulary), OLMo 3 with a
    # sliding-window layer whose window (8) is shorter than the batch's
    "smollm3": ("SmolLM3Config", dict(_DENSE, no_rope_layers=[1, 0], pad_token_id=None)),
    "olmo3": ("Olmo3Config", dict(_DENSE, sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
    "llama": ("LlamaConfig", dict(_DENSE)),
    "mistral": ("MistralConfig", dict(_DENSE, sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(_DENSE)),
}
# the families whose save and resume at tp=2 (`plan_resume`, about 2 CPU-s each) the suite's smoke measures: the two
# only the newer transformers build, SmolLM3 with its tied head (Gemma 3's tied head resumes through the engine in
# tests/test_named_rows_dist.py); `--plan` resumes every family
SMOKE_RESUME = ("smollm3", "olmo3")
# one handling dropped each: the check must catch it (works False)
PLAN_VARIANTS: dict[str, tuple[str, str]] = {
    "qwen3-norm_grad_sum": ("qwen3", "the q/k norms' gradients not summed over the tp group"),
    "starcoder2-plan_fix": ("starcoder2", "transformers 4.51.3's plan as it ships (mlp.c_proj colwise)"),
}


def _gathered(p_local, whole_shape, group):
    """A tp rank's shard of a parameter (or gradient) gathered along the dim it is split on."""
    import torch
    import torch.distributed as dist

    if tuple(p_local.shape) == tuple(whole_shape):
        return p_local
    dim = next(d for d in range(len(whole_shape)) if p_local.shape[d] != whole_shape[d])
    parts = [torch.empty_like(p_local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, p_local.contiguous(), group=group)
    return torch.cat(parts, dim=dim)[tuple(slice(0, n) for n in whole_shape)]


def _plan_model(name: str):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    cls, fields = PLAN_TINY[name]
    config = getattr(transformers, cls)(vocab_size=VOCAB, **fields)
    for field in DROPOUT_FIELDS:
        if isinstance(getattr(config, field, None), float):
            setattr(config, field, 0.0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def plan_probe(name: str, steps: int = 2, lr: float = 0.5, resume: bool = True) -> dict:
    """The derived policy at tp=2 against the unsharded model: losses, gradients, converted weights; and a
    resume from a checkpoint saved at tp=2, bitwise (`plan_resume`)."""
    import shutil
    import tempfile
    from dataclasses import replace

    import torch
    import torch.distributed as dist
    from colossalai.booster import Booster
    from colossalai.booster.plugin import HybridParallelPlugin

    from tasks.core.models.convert import convert_checkpoint, load_state_dict_from_dir
    from tasks.core.models.tp_plan import PLAN_ROWS, PlanRow
    from tasks.engine.plan_policy import PlanPolicy

    base, why = PLAN_VARIANTS.get(name, (name, ""))
    row = PLAN_ROWS.get(base) or PlanRow("")
    if name in PLAN_VARIANTS:  # the row without its fixes
        row = replace(row, fixes=())
    model = _plan_model(base)
    out: dict = {"family": name, "class": type(model).__name__, "tied": bool(model.config.tie_word_embeddings)}
    if why:
        out["variant"] = why
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(steps):
        ids = torch.randint(4, VOCAB, (BATCH, SEQ), generator=g)
        batches.append({"input_ids": ids, "labels": ids.clone()})
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    ref_losses, ref_grads = [], {}
    for i, batch in enumerate(batches):
        loss = ref.train()(**batch).loss
        loss.backward()
        ref_losses.append(loss.item())
        if i == 0:
            ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
        ref_opt.step()
        ref_opt.zero_grad()
    whole = {n: p.shape for n, p in ref.named_parameters()}
    stage = "boost"
    try:
        plugin = HybridParallelPlugin(
            tp_size=2, pp_size=1, zero_stage=0, precision="fp32", overlap_communication=False,
            enable_all_optimization=False, make_vocab_size_divisible_by=1, custom_policy=PlanPolicy(row),
        )  # fmt: skip
        booster = Booster(plugin=plugin)
        optim = torch.optim.SGD(model.parameters(), lr=lr)
        model, optim, *_ = booster.boost(model, optim)
        split = sum(1 for n, p in model.unwrap().named_parameters() if tuple(p.shape) != tuple(whole[n]))
        out["split_params"] = split
        losses, grad_err = [], {}
        for i, batch in enumerate(batches):
            stage = f"step {i + 1}"
            loss = model.train()(**batch).loss
            booster.backward(loss, optim)
            losses.append(loss.item())
            if i == 0:
                for n, p in model.unwrap().named_parameters():
                    got, want = _gathered(p.grad, whole[n], plugin.tp_group), ref_grads[n]
                    grad_err[n] = float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))
            optim.step()
            optim.zero_grad()
        out["loss_rel"] = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        worst = max(grad_err, key=grad_err.get)
        out["grad_rel"], out["grad_worst"] = grad_err[worst], worst
        stage = "save and convert"
        obj = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(obj, src=0)
        tmp = obj[0]
        booster.save_model(model, f"{tmp}/ckpt", shard=True, use_safetensors=True)
        dist.barrier()
        found: list = [None]
        if dist.get_rank() == 0:  # the unshard's conversion, then the weights against the unsharded model's
            try:
                convert_checkpoint(f"{tmp}/ckpt", f"{tmp}/hf", model_config=ref.config.to_dict(), fsync=False)
                got = load_state_dict_from_dir(f"{tmp}/hf")
                tied = ref.config.tie_word_embeddings
                want = {k: v for k, v in ref.state_dict().items() if k in got or not tied}
                found = [{
                    "weight_rel": max(float((got[k] - v).abs().max() / v.abs().max().clamp_min(1e-12))
                                      for k, v in want.items() if k in got),
                    "weights_missing": sorted(set(want) - set(got)),
                }]  # fmt: skip
            except Exception as exc:  # said on every rank, not raised on one
                found = [{"failure": f"save and convert: {type(exc).__name__}: {str(exc)[:300]}"}]
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        dist.broadcast_object_list(found, src=0)
        out.update(found[0])
        if "failure" in out:
            out["works"] = False
            return out
        # as the engine builds it: lazily (LazyInitContext), materialized as the plugin shards it; its random weights
        # are not these, so its loss is only finite, and the embedding scale the policy keeps is the model's own
        stage = "lazily built forward"
        out["lazy_loss"], lazy_scale = plan_lazy(ref.config, row, batches[0])
        ref_scale = getattr(ref.get_input_embeddings(), "embed_scale", None)
        out["lazy_scale_ok"] = lazy_scale == (None if ref_scale is None else float(ref_scale))
        ok = out["loss_rel"] <= 1e-5 and out["grad_rel"] <= 1e-4 and out["weight_rel"] <= 1e-4 and split > 0
        ok = ok and math.isfinite(out["lazy_loss"]) and out["lazy_scale_ok"]
        if resume and not why:  # a variant's dropped handling is caught above; its resume proves nothing more
            stage = "save and resume"
            cpu = time.process_time()
            out.update(plan_resume(ref.config, row, batches))
            out["resume_cpu_s"] = round(time.process_time() - cpu, 2)  # rank 0's, the launch's imports aside
            ok = ok and out["resume_bitwise"]
        out["works"] = ok and not out.get("weights_missing")
    except Exception as exc:
        out["works"] = False
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        out["failure"] = f"{stage}: {type(exc).__name__}: {first} at {where(exc)}"
        if os.environ.get("POLICY_TRACEBACK"):
            traceback.print_exc()
    return out


def plan_resume(config, row, batches: list[dict]) -> dict:
    """Save and resume at tp=2 under the derived policy, as the engine does it: AdamW (the engine's optimizer, whose
    state must come back too), fp32 and ZeRO-0 (the layout the derived flows train SmolLM3 and OLMo 3 at tp=2 in;
    ZeRO-1 in bf16, the fp32 masters saved beside, is the engine resume of tests/test_named_rows_dist.py), one
    step, the model and the optimizer saved as `Engine.save` saves them (`booster.save_model` sharded
    safetensors, `booster.save_optimizer` sharded), a second step; then a fresh model
    built lazily and boosted as a resumed launch builds it (`Engine.from_config`, `Engine.boost`), the checkpoint read
    into its shards as `Engine.load` reads it (`weights.read_into`, a tied head from the tensor it is tied to,
    `update_master_params`, `booster.load_optimizer`), and the second step again: its loss and every rank's
    parameters after it must be bitwise the first run's (same layout, same batch, no dropout)."""
    import shutil
    import tempfile
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from colossalai.booster import Booster
    from colossalai.booster.plugin import HybridParallelPlugin
    from colossalai.lazy import LazyInitContext
    from transformers import AutoModelForCausalLM

    from tasks.engine import weights
    from tasks.engine.plan_policy import PlanPolicy

    def boosted(lazy: bool):
        torch.manual_seed(0)
        if lazy:
            with LazyInitContext(default_device=torch.device("cpu")):
                model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plugin = HybridParallelPlugin(
            tp_size=2, pp_size=1, zero_stage=0, precision="fp32", overlap_communication=False,
            enable_all_optimization=False, make_vocab_size_divisible_by=1, custom_policy=PlanPolicy(row),
        )  # fmt: skip
        booster = Booster(plugin=plugin)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optim, *_ = booster.boost(model, optim)
        return booster, model, optim

    def step(booster, model, optim, batch) -> float:
        loss = model.train()(**batch).loss
        booster.backward(loss, optim)
        optim.step()
        optim.zero_grad()
        return loss.item()

    obj = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(obj, src=0)
    ckpt = Path(obj[0])
    try:
        booster, model, optim = boosted(lazy=False)
        step(booster, model, optim, batches[0])
        booster.save_model(model, str(ckpt / "model"), shard=True, use_safetensors=True)
        booster.save_optimizer(optim, str(ckpt / "optimizer"), shard=True)
        dist.barrier()
        first = step(booster, model, optim, batches[1])
        want = {n: p.detach().clone() for n, p in model.unwrap().named_parameters()}
        booster, model, optim = boosted(lazy=True)
        weights.read_into(model.unwrap(), ckpt / "model", config.to_dict())
        model.update_master_params()
        booster.load_optimizer(optim, str(ckpt / "optimizer"))
        again = step(booster, model, optim, batches[1])
        got = dict(model.unwrap().named_parameters())
        same = sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
        flags = torch.tensor([float(same and again == first)])
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)  # every rank's shards, not rank 0's alone
        return {"resume_bitwise": bool(flags.item()), "resume_loss": [first, again]}
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(ckpt, ignore_errors=True)


def variant_applies(name: str) -> bool:
    """Whether a variant's dropped fixes change the plan the installed transformers ships (a later release may
    ship the fix: StarCoder2's c_proj is rowwise from 4.57); False for a family itself."""
    from dataclasses import replace

    import transformers

    from tasks.core.models.tp_plan import PLAN_ROWS, merged_plan

    if name not in PLAN_VARIANTS:
        return False
    base = PLAN_VARIANTS[name][0]
    row = PLAN_ROWS[base]
    config_class = getattr(transformers, PLAN_TINY[base][0])
    shipped = getattr(config_class, "base_model_tp_plan", None) or {}
    return merged_plan(row, shipped, {}, "") != merged_plan(replace(row, fixes=()), shipped, {}, "")


def plan_lazy(config, row, batch: dict) -> tuple[float, float | None]:
    """The loss of a model built lazily under the derived policy at tp=2, and the embedding scale it kept."""
    import torch
    from colossalai.booster import Booster
    from colossalai.booster.plugin import HybridParallelPlugin
    from colossalai.lazy import LazyInitContext
    from transformers import AutoModelForCausalLM

    from tasks.engine.plan_policy import PlanPolicy

    with LazyInitContext(default_device=torch.device("cpu")):
        lazy = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    policy = PlanPolicy(row)
    plugin = HybridParallelPlugin(
        tp_size=2, pp_size=1, zero_stage=0, precision="fp32", overlap_communication=False,
        enable_all_optimization=False, make_vocab_size_divisible_by=1, custom_policy=policy,
    )  # fmt: skip
    model, *_ = Booster(plugin=plugin).boost(lazy)
    with torch.no_grad():
        return model.eval()(**batch).loss.item(), policy.embed_scale


def time_steps(family: str, derived: bool, steps: int = 10) -> float:
    """Seconds per tp=2 training step (forward, backward, SGD step) of a tiny family, after one warm-up step."""
    import time

    import torch
    from colossalai.booster import Booster
    from colossalai.booster.plugin import HybridParallelPlugin

    from tasks.engine.plan_policy import PlanPolicy

    model = _plan_model(family)
    plugin = HybridParallelPlugin(
        tp_size=2, pp_size=1, zero_stage=0, precision="fp32", overlap_communication=False,
        enable_all_optimization=False, make_vocab_size_divisible_by=1,
        custom_policy=PlanPolicy() if derived else None,
    )  # fmt: skip
    booster = Booster(plugin=plugin)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optim, *_ = booster.boost(model, optim)
    ids = torch.randint(4, VOCAB, (BATCH, 64), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids.clone()}
    start = 0.0
    for i in range(steps + 1):
        if i == 1:
            torch.distributed.barrier()
            start = time.perf_counter()
        booster.backward(model.train()(**batch).loss, optim)
        optim.step()
        optim.zero_grad()
    torch.distributed.barrier()
    return (time.perf_counter() - start) / steps


# SmolLM2-135M's architecture (its config.json on the Hub: LlamaConfig), with fewer layers: 9 heads and 3 KV
# heads take tp=3 (and 1, 9), not tp=2; vocabulary 49152 = 3 x 16384
SMOLLM2 = dict(
    hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
    tie_word_embeddings=True, rope_theta=100000.0, max_position_embeddings=8192, rms_norm_eps=1e-5,
    hidden_act="silu", initializer_range=0.041666666666666664,
)  # fmt: skip


def smollm2_blocks(seq: int, train: int, held_out: int) -> tuple[list, list]:
    """CPT blocks of `seq` tokens from data/sample/cpt.jsonl, one token a UTF-8 byte (no SmolLM2 tokenizer offline):
    the first `train` blocks to train on, the next `held_out` never trained on, for the held-out perplexity."""
    import json
    from pathlib import Path

    import torch

    corpus = Path(__file__).resolve().parent.parent / "data/sample/cpt.jsonl"
    text = " ".join(json.loads(line)["text"] for line in corpus.read_text().splitlines() if line.strip())
    ids = torch.tensor(list(text.encode()), dtype=torch.long)
    blocks = ids[: (train + held_out) * seq].view(train + held_out, seq)
    return list(blocks[:train]), list(blocks[train:])


def smollm2_cpt(layers: int, steps: int, tp: int = 3, seq: int = 128, batch: int = 2) -> list[dict]:
    """CPT of a random model of SmolLM2-135M's shape at tp (fp32, AdamW, ZeRO-0, as the engine trains at tp) under
    ColossalAI's Llama policy (its forward, with tasks/engine/hf_compat.py's edits) and under the derived policy (the
    model's own forward), from the same random weights (seed 0) on the same blocks, a step of one then a step of the
    other so both see the same load: each step's loss, the held-out perplexity before and after, and the median
    step time."""
    import time as _time

    import torch
    from colossalai.booster import Booster
    from colossalai.booster.plugin import HybridParallelPlugin
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tasks.engine.plan_policy import PlanPolicy

    config = LlamaConfig(num_hidden_layers=layers, **SMOLLM2)
    train, held = smollm2_blocks(seq, steps * batch, 4)
    runs = []
    for derived in (False, True):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plugin = HybridParallelPlugin(
            tp_size=tp, pp_size=1, zero_stage=0, precision="fp32", overlap_communication=False,
            enable_all_optimization=False, make_vocab_size_divisible_by=1,
            custom_policy=PlanPolicy() if derived else None,
        )  # fmt: skip
        booster = Booster(plugin=plugin)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
        model, optim, *_ = booster.boost(model, optim)
        out = {"policy": "derived" if derived else "colossalai", "tp": tp, "layers": layers, "seq": seq}
        runs.append((out, booster, model, optim, []))

    def held_out_ppl(model) -> float:
        with torch.no_grad():
            model.eval()
            mean = sum(model(input_ids=b[None], labels=b[None]).loss.item() for b in held) / len(held)
        return math.exp(mean)

    for out, _, model, _, _ in runs:
        out["ppl_before"], out["losses"] = held_out_ppl(model), []
    for i in range(steps):
        ids = torch.stack(train[i * batch : (i + 1) * batch])
        for out, booster, model, optim, times in runs:
            t0 = _time.perf_counter()
            loss = model.train()(input_ids=ids, labels=ids).loss
            booster.backward(loss, optim)
            optim.step()
            optim.zero_grad()
            times.append(_time.perf_counter() - t0)
            out["losses"].append(loss.item())
    for out, _, model, _, times in runs:
        out["ppl_after"] = held_out_ppl(model)
        warm = sorted(times[1:] or times)
        out["step_s"] = warm[len(warm) // 2]
    return [r[0] for r in runs]
