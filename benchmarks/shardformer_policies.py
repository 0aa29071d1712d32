"""Which of ColossalAI 0.5.0's shardformer policies for decoder families run with the installed transformers.

    torchrun --standalone --nproc-per-node 2 benchmarks/shardformer_policies.py            # every family, tp=2
    torchrun --standalone --nproc-per-node 2 benchmarks/shardformer_policies.py gpt2 opt   # some
    torchrun --standalone --nproc-per-node 2 benchmarks/shardformer_policies.py --pp       # every family, pp=2
    torchrun --standalone --nproc-per-node 2 benchmarks/shardformer_policies.py falcon@pp2 # one, pp=2 (tp=1)
    torchrun --standalone --nproc-per-node 2 benchmarks/shardformer_policies.py --smoke    # the rows' claims, plan ones too
    torchrun --standalone --nproc-per-node 2 benchmarks/shardformer_policies.py --plan     # derived policy, every family
    torchrun --standalone --nproc-per-node 2 benchmarks/shardformer_policies.py --plan qwen3 llama  # some
    torchrun --standalone --nproc-per-node 2 benchmarks/shardformer_policies.py --time llama  # step time, both policies
    torchrun --standalone --nproc-per-node 3 benchmarks/shardformer_policies.py --smollm2 4 8  # SmolLM2's shape, tp=3

For each causal-LM class that ColossalAI's `auto_policy` maps to a policy (the remote-code ones,
`transformers_modules.*`, are left out: the project never runs code from a model folder), a tiny
random fp32 model of the family (its config class's own dropout) goes through HybridParallelPlugin at
tp=2 on 2 gloo ranks (CPU, `tasks.engine.cpu_compat`, as the engine runs), fed a CPT block as the
engine feeds it (input_ids and labels; an all-ones mask where the row says, `needs_attention_mask`):
boost, the engine's live logits fingerprint (`boosted._live_logits`) and the loss in eval mode against
the unsharded model's, a training forward, backward, one optimizer step, the parameters tp does not
split compared across the tp ranks, a second forward, and the same model built lazily as the engine
builds it (LazyInitContext, where the row does not say `eager_build`), one forward. A family with a row
in tasks/core/models/policy_rows.py is built and sharded with what its row has the engine pass
(`shard_settings`: attention implementation, shardformer flags) and what pre-flight admits at tp
(`tp_requires`); `VARIANTS` measure some without, to show why. It works when every step finishes, the
sharded loss and logits equal the unsharded model's (same weights, same batch) within 1e-4, the
replicated parameters are equal on the tp ranks, and the losses after the step and of the lazily built
model are finite. Otherwise the first failure is reported with where it was raised. One JSON line per
family (`@@policy {...}`), from rank 0; the results are written down in benchmarks/results/ and the
rows of policy_rows.py. `--smoke` measures every row at tp=2, and at pp=2 where the row claims it, in
one launch, and exits 1 when one disagrees with its row (a policy refused there that trains, or a claim
that fails).

`--plan` proves the derived policy (`tasks.engine.plan_policy.PlanPolicy`, read from transformers' own
tensor-parallel plan and a row of `tasks.core.models.tp_plan.PLAN_ROWS`) for each family, against the
unsharded model with the same weights and batch, fp32, SGD (AdamW's eps turns gradient noise of 1e-7 into
moves of 0.1-0.2 relative on near-zero weights, even in one process): the loss of two training steps,
every parameter's gradient after the first (each rank's shard gathered along the dim it is split on),
and the weights after the steps as saved at tp=2 (`booster.save_model`, gathered to HF keys) and
converted by the project's converter (`convert_checkpoint`), tied keys dropped as the unshard drops them.
`PLAN_VARIANTS` drop one handling each, to show the check catches it (the q/k norm gradient sum, the
corrected StarCoder2 plan). Each family is then saved and resumed at tp=2 (`plan_resume`: AdamW, the
checkpoint read back as the engine reads it, the step after the save redone bitwise). One `@@plan {...}`
line per family; `--smoke` measures the PLAN_ROWS families, Llama and the variants in the same launch as
the policy rows, resuming SmolLM3 and OLMo 3 only (`SMOKE_RESUME`). `--smollm2 [layers] [steps]` (3
ranks) trains a random model of SmolLM2-135M's shape at tp=3 under ColossalAI's Llama policy and the
derived one, the same weights and blocks, and compares their losses and held-out perplexity (`@@smollm2`).
A row whose family the installed transformers does not build yet (its `min_transformers`: SmolLM3, OLMo 3 on 4.51.3) is not measured: its
line says `skipped` and why. `--time` times tp=2 training steps of
tiny Llama with ColossalAI's policy and with the derived one (`@@time`).

`<family>@pp2` runs the check at pp=2 (tp=1) through the 1F1B schedule (`execute_pipeline`, two
training passes, as the engine runs a pipeline; dropout off, since the loss is compared in training mode). A stage that raises would leave the other waiting on
its point-to-point receive, which the process-group timeout does not bound, so the rank that raised
prints its failure and ends the launch (torchrun stops the other): families after it are not measured.
At tp a failure is deterministic and the same on both ranks (a policy that does not fit the installed
model's modules fails while sharding, before any collective), so the loop goes on to the next family;
a process-group timeout of 120 s bounds a rank that waits on one that raised.
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
import traceback
from datetime import timedelta

import _checkout  # noqa: F401 - first: the checkout on sys.path (support/ is not installed)
from plan_policies import (  # the derived policy's probe; the constants and `where` both measurements share
    BATCH,
    DROPOUT_FIELDS,
    PLAN_TINY,
    PLAN_VARIANTS,
    SEQ,
    SMOKE_RESUME,
    VOCAB,
    plan_probe,
    time_steps,
    variant_applies,
    where,
)

# tiny configs: hidden 64, 4 heads (2 per tp rank), 2 layers, each family's own dropout (GPT-2's and OPT's
# 0.1: the losses are compared in eval mode, and at tp the step is checked to keep the replicated parameters
# equal on every tp rank); config class name -> fields
TINY: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2)),
    "mistral": ("MistralConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2)),
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, n_positions=64)),
    "gptj": ("GPTJConfig", dict(n_embd=64, n_layer=2, n_head=4, n_positions=64, rotary_dim=8)),
    "opt": ("OPTConfig", dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                              max_position_embeddings=64, word_embed_proj_dim=64)),
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
# A policy row's family is measured as the engine runs it: with the attention implementation and the
# shardformer flags its row names (`policy_rows.shard_settings`). These variants measure the same families
# without them, to show why the row names them: OPT's policy knows eager and flash_attention_2 only
# (transformers 4.51 builds sdpa by default) and its flash-attention forward fails; Cohere's attention
# forward asserts the mask that only the flag's model forward makes; GPT-2's model forward without the
# flag hands sdpa a padding mask with no causal part (the loss differs from the unsharded model's).
VARIANTS: dict[str, tuple[str, dict, dict]] = {
    "opt+sdpa": ("opt", {"attn_implementation": "sdpa"}, {}),
    "opt+flash_attention": ("opt", {}, {"enable_flash_attention": True}),
    "cohere-flash_attention": ("cohere", {}, {"enable_flash_attention": False}),
    "gpt2-flash_attention": ("gpt2", {}, {"enable_flash_attention": False}),
    "gpt2+dropout": ("gpt2", {"resid_pdrop": 0.1, "embd_pdrop": 0.1}, {}),
    "gptj+dropout": ("gptj", {"resid_pdrop": 0.1, "embd_pdrop": 0.1}, {}),
    "bloom+dropout": ("bloom", {"hidden_dropout": 0.1}, {}),
    "falcon+dropout": ("falcon", {"hidden_dropout": 0.1}, {}),
    "gptj+lazy": ("gptj", {"lazy": True}, {}),
}


def fingerprint_diff(plugin, model, unsharded, model_type: str) -> float:
    """Largest |logit| difference on the fingerprint's probe batch (eval mode) between the boosted model, its
    tp shards gathered as the engine's live fingerprint takes them (`boosted._live_logits`), and the unsharded
    model with the same weights."""

    from tasks.core.models.fingerprint import model_logits
    from tasks.core.models.policy_rows import needs_attention_mask
    from tasks.engine.boosted import _live_logits

    vocab = unsharded.config.vocab_size
    live = _live_logits(model, vocab, plugin.tp_group, as_trained=needs_attention_mask(model_type))
    return float((live - model_logits(unsharded, vocab)).abs().max())


def replica_diff(plugin, model, unsharded) -> float:
    """Largest difference between the tp ranks' copies of the parameters tp does not split (those whose shape is
    the unsharded model's): a step must keep them equal, or a checkpoint (tp rank 0's) is not the model trained."""
    import torch
    import torch.distributed as dist

    whole = dict(unsharded.named_parameters())
    worst = torch.zeros(())
    for name, p in model.unwrap().named_parameters():
        if name in whole and p.shape == whole[name].shape:
            parts = [torch.empty_like(p) for _ in range(dist.get_world_size(plugin.tp_group))]
            dist.all_gather(parts, p.detach().contiguous(), group=plugin.tp_group)
            worst = torch.maximum(worst, max((q - parts[0]).abs().max() for q in parts))
    return float(worst)


def lazy_loss(config, model_kw: dict, plugin_kw: dict, batch: dict) -> float:
    """The loss of the model built as the engine builds it under hybrid_parallel (ColossalAI's LazyInitContext,
    materialized shard by shard by the plugin; its random weights are not the eager model's): a module that keeps
    a plain tensor the context leaves on the meta device fails here."""
    import torch
    from colossalai.booster import Booster
    from colossalai.booster.plugin import HybridParallelPlugin
    from colossalai.lazy import LazyInitContext
    from transformers import AutoModelForCausalLM

    with LazyInitContext(default_device=torch.device("cpu")):
        lazy = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **model_kw)
    plugin = HybridParallelPlugin(
        **plugin_kw, zero_stage=0, precision="fp32", overlap_communication=False, enable_all_optimization=False,
        make_vocab_size_divisible_by=1,
    )  # fmt: skip
    model, *_ = Booster(plugin=plugin).boost(lazy)
    with torch.no_grad():
        return model.eval()(**batch).loss.item()


def probe(name: str) -> dict:
    import torch
    import transformers
    from colossalai.booster import Booster
    from colossalai.booster.plugin import HybridParallelPlugin
    from transformers import AutoModelForCausalLM

    from tasks.core.models.policy_rows import POLICY_ROWS, lazy_init_safe, needs_attention_mask, shard_settings

    name, _, layout = name.partition("@")  # "falcon@pp2": pipeline parallelism instead of tp
    base, model_over, plugin_over = VARIANTS.get(name, (name, {}, {}))
    model_kw, plugin_kw = shard_settings(base.removesuffix("_new_arch"))
    model_kw, plugin_kw = {**model_kw, **model_over}, {**plugin_kw, **plugin_over}
    pp = layout == "pp2"
    cls, fields = TINY[base]
    config = getattr(transformers, cls)(vocab_size=VOCAB, **fields)
    for field in DROPOUT_FIELDS if pp else ():
        if isinstance(getattr(config, field, None), float):
            setattr(config, field, 0.0)
    row = POLICY_ROWS.get(base.removesuffix("_new_arch"))
    for field, value, _ in row.tp_requires if row and not pp else ():  # what pre-flight admits at tp
        setattr(config, field, value)
    lazy = model_kw.pop("lazy", lazy_init_safe(base.removesuffix("_new_arch")))  # a variant may force it
    settings = {**model_kw, **plugin_kw, **({"lazy": True} if lazy and "lazy" in model_over else {})}
    for field in [k for k in model_kw if hasattr(config, k)]:  # a variant's config field, not a model argument
        setattr(config, field, model_kw.pop(field))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **model_kw)
    out: dict = {"family": name + ("@pp2" if pp else ""), "class": type(model).__name__}
    if settings:
        out["settings"] = settings
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, VOCAB, (BATCH, SEQ), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}  # a CPT block, as the engine trains on it
    if needs_attention_mask(base.removesuffix("_new_arch")):  # the engine adds one where the row says so
        batch["attention_mask"] = torch.ones_like(ids)
    with torch.no_grad():
        ref = model.eval()(**batch).loss.item()
    model.train()
    unsharded = copy.deepcopy(model) if not pp else None  # the same weights, for the fingerprint forward
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
            # the loss after the step from a second training pass, as the engine runs a pipeline: a forward-only
            # one (optimizer None) all-reduces the tied embedding's gradient, None after zero_grad (TypeError)
            stage = "second pipeline forward"
            res = booster.execute_pipeline(iter([batch]), model, lambda o, _: o.loss, optim, return_loss=True)
            optim.zero_grad()
            after_t = torch.tensor([res["loss"].item() if last else 0.0])
            torch.distributed.all_reduce(after_t)
            after = after_t.item()
        else:
            # the engine's live fingerprint of the model it trains (boosted._live_logits)
            stage = "fingerprint forward"
            out["fingerprint_diff"] = fingerprint_diff(plugin, model, unsharded, base.removesuffix("_new_arch"))
            stage = "forward"
            with torch.no_grad():
                out["loss"], out["ref_loss"] = model.eval()(**batch).loss.item(), ref
            loss = model.train()(**batch).loss
            stage = "backward"
            booster.backward(loss, optim)
            stage = "step"
            optim.step()
            optim.zero_grad()
            out["replica_diff"] = replica_diff(plugin, model, unsharded)
            stage = "second forward"
            with torch.no_grad():
                after = model.eval()(**batch).loss.item()
            if lazy:  # as the engine builds it: lazily (LazyInitContext), materialized by the plugin as it shards
                stage = "lazily built forward"
                out["lazy_loss"] = lazy_loss(config, model_kw, {**layout_kw, **plugin_kw}, batch)
        out["loss_after_step"] = after
        ok = abs(out["loss"] - ref) <= 1e-4 and math.isfinite(after) and out.get("fingerprint_diff", 0.0) <= 1e-4
        ok = ok and out.get("replica_diff", 0.0) <= 1e-6 and math.isfinite(out.get("lazy_loss", 0.0))
        out["works"] = ok
        if not ok:
            out["failure"] = (
                f"{'pp' if pp else 'tp'}=2 loss {out['loss']:.6f} vs unsharded {ref:.6f}, after a step {after}, "
                f"fingerprint logits off by {out.get('fingerprint_diff', 0.0):.2e}, the replicated parameters "
                f"{out.get('replica_diff', 0.0):.2e} apart on the tp ranks after the step"
            )
    except Exception as exc:
        out["works"] = False
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        out["failure"] = f"{stage}: {type(exc).__name__}: {first} at {where(exc)}"
        if os.environ.get("POLICY_TRACEBACK"):
            traceback.print_exc()
        if pp:  # the other stage may wait on this one's send for ever: end the launch (torchrun stops it)
            print("@@policy " + json.dumps(out), flush=True)
            os._exit(1)
    return out


def disagreement(name: str, works: bool) -> str | None:
    """How a measurement contradicts the claim of its policy row (tp: policy_refused; @pp2: pp), or None."""
    from tasks.core.models.policy_rows import POLICY_ROWS

    base, _, layout = name.partition("@")
    row = POLICY_ROWS.get(base)
    if row is None:
        return None
    if layout == "pp2":
        return None if works == row.pp else f"{name}: measured works={works}, its row says pp={row.pp}"
    if works != bool(row.policy_refused):
        return None
    return f"{name}: measured works={works}, its row says policy_refused={row.policy_refused!r}"


def main() -> int:
    import torch
    import torch.distributed as dist

    from tasks.engine import cpu_compat
    from tasks.engine.lazy_compile import import_colossalai

    import_colossalai()
    from tasks.engine import hf_compat

    hf_compat.apply()  # ColossalAI's forwards on the installed transformers
    if not torch.cuda.is_available():
        cpu_compat.apply()
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    from tasks.core.models.policy_rows import POLICY_ROWS

    args = sys.argv[1:]
    rank0 = int(os.environ.get("RANK", "0")) == 0
    from tasks.core.models.tp_plan import PLAN_ROWS

    plan_names: list[str] = []
    if args[:1] == ["--time"]:  # step time at tp=2, ColossalAI's policy and the derived one
        for family in args[1:] or ["llama"]:
            for derived in (False, True, False, True):
                sec = time_steps(family, derived)
                if rank0:
                    policy = "derived" if derived else "colossalai"
                    print("@@time " + json.dumps({"family": family, "policy": policy, "step_s": sec}), flush=True)
        dist.destroy_process_group()
        return 0
    if args[:1] == ["--smollm2"]:  # SmolLM2-135M's shape at tp=3 (3 ranks), both policies, same weights and blocks
        from plan_policies import smollm2_cpt

        layers, steps = (int(a) for a in (args[1:] + ["4", "8"][len(args[1:]) :])[:2])
        runs = smollm2_cpt(layers, steps, tp=dist.get_world_size())
        if rank0:
            for run in runs:
                print("@@smollm2 " + json.dumps(run), flush=True)
            colossal, derived = runs
            loss_rel = max(abs(a - b) / b for a, b in zip(derived["losses"], colossal["losses"]))
            ppl_rel = abs(derived["ppl_after"] - colossal["ppl_after"]) / colossal["ppl_after"]
            print("@@smollm2 " + json.dumps({"loss_rel": loss_rel, "ppl_rel": ppl_rel}), flush=True)
        dist.destroy_process_group()
        return 0
    if args[:1] == ["--plan"]:
        plan_names, names = args[1:] or [*PLAN_TINY, *PLAN_VARIANTS], []
    elif args == [
        "--smoke"
    ]:  # the families with a policy row, each against its row's claims: tp=2, and pp=2 where claimed
        names = sorted(POLICY_ROWS) + [f"{n}@pp2" for n, row in sorted(POLICY_ROWS.items()) if row.pp]
        # Llama too: ColossalAI's policy runs it, and the derived one matching the unsharded model here is what makes
        # the two equal at tp=2 (--smollm2 compares them directly at SmolLM2's shape, tp=3)
        plan_names = [*sorted(PLAN_ROWS), "llama", *PLAN_VARIANTS]
    elif args == ["--pp"]:  # every family at pp=2
        names = [f"{n}@pp2" for n in TINY]
    else:
        names = args or [*TINY, *VARIANTS]
    wrong = []
    for name in names:
        result = probe(name)
        if (why := disagreement(name, result["works"])) is not None:
            wrong.append(why)
        if int(os.environ.get("RANK", "0")) == 0:
            print("@@policy " + json.dumps(result), flush=True)
    from tasks.core.models.tp_plan import too_old

    for name in plan_names:
        if why := too_old(PLAN_VARIANTS.get(name, (name,))[0]):  # the installed transformers does not build it
            if rank0:
                print("@@plan " + json.dumps({"family": name, "works": False, "skipped": why}), flush=True)
            continue
        result = plan_probe(name, resume=args != ["--smoke"] or name in SMOKE_RESUME)
        result["variant_applies"] = variant_applies(name)
        if result["works"] == result["variant_applies"]:  # a row that does not train like the unsharded model
            wrong.append(f"{name}: the derived policy measured works={result['works']}")
        if rank0:
            print("@@plan " + json.dumps(result), flush=True)
    dist.destroy_process_group()
    if wrong and int(os.environ.get("RANK", "0")) == 0:
        print("rows of tasks/core/models/policy_rows.py that disagree with the measurement:\n" + "\n".join(wrong))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
