"""One stage's plugin, booster, boosted model/optimizer/scheduler and checkpoint save/load.

Used by the verbs in `tasks/engine/loop.py`, inside every torchrun rank:

    torchrun --nproc_per_node=2 -m tasks.engine train --config JOB.json

Optimizer: `torch.optim.AdamW` on every plugin but Gemini (which accepts only ColossalAI's
HybridAdam/FusedAdam/CPUAdam and gets HybridAdam in AdamW mode). HybridAdam needs ColossalAI's
compiled CPU-Adam / fused-Adam kernels: here (colossalai 0.5.0 installed --no-deps, no kernels
built) `HybridAdam(...)` fails with "No usable kernel found for CPUAdamLoader". The plugins wrap
any torch optimizer (mixed-precision master weights, ZeRO sharding, gradient clipping) and AdamW's state
round-trips exactly through ColossalAI's optimizer checkpoints. One parameter group; weight decay
applies to every parameter. On CUDA AdamW takes `fused=True` where the kernel registry has it on
(`fused_optimizer`, tasks/core/config/kernels.py); its state has the same format (step on the device).

LR schedule: `torch.optim.lr_scheduler.LambdaLR` with a plain function (linear warm-up, then
cosine/linear decay to min_lr, or constant): one scheduler, one state format (numbers only, so
`lr_scheduler.pt` loads under `weights_only=True`) for all three PhaseConfig schedules.
ColossalAI's CosineAnnealingWarmupLR covers the cosine case only and its LinearWarmupLR has no
min_lr floor.

Fingerprint: pp == 1 -> the live boosted model on every rank (tensor-parallel vocab shards
gathered), i.e. exactly the weights being trained in their training dtype; pp > 1 -> no rank holds
the whole model, so rank 0 computes them from the just-saved `model/` with plain `transformers`,
whole up to the job's `verify_memory_gb`, streamed a decoder layer at a time above it.

What differs between plugins is read from the registry (`tasks.core.config.plugins`), never from a name.
"""

from __future__ import annotations

import contextlib
import copy
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tasks.core.config.context import changes_text, config_changes
from tasks.core.config.kernels import KernelState
from tasks.core.config.kernels import record as kernel_record
from tasks.core.config.phases import PHASES
from tasks.core.config.plugins import spec_of
from tasks.core.errors import ManifestError
from tasks.core.models.convert.state_view import MASTERS, CheckpointState
from tasks.core.models.fingerprint import hf_dir_logits, model_logits, probe_forward, save_fingerprint
from tasks.core.models.policy_rows import lazy_init_safe, needs_attention_mask, shard_settings
from tasks.core.models.preference import metrics as preference_metrics
from tasks.core.run import segments
from tasks.core.run.events import CHECKPOINT, DETAIL, INFO, format_event
from tasks.core.run.manifest import write_manifest
from tasks.engine import accel, hostmem, lora, masters, node_staging, rankio, state_read, weights
from tasks.engine import checkpoint as ckpt
from tasks.engine.backpressure import wait_for_publishes
from tasks.engine.builders import (
    booster_mixed_precision,
    can_no_sync,
    check_model,
    layout_of,
    make_plugin,
    plugin_meta,
    uses_autocast,
)
from tasks.engine.faults import Injector
from tasks.engine.optim import make_optimizer, make_scheduler
from tasks.engine.packing import model_inputs
from tasks.engine.pairs import SUMS as PAIR_SUMS
from tasks.engine.pairs import PairLoss
from tasks.engine.pairs import add_sums as add_pair_sums
from tasks.engine.preconditions import Job

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


def log(msg: str, all_ranks: bool = False, detail: bool = False) -> None:
    """Rank 0's line (every rank's with `all_ranks`); `detail`: for the run's log, not the console."""
    if all_ranks or dist.get_rank() == 0:
        rankio.say(msg, DETAIL if detail else INFO)


def emit(kind: str, record: dict[str, Any]) -> None:
    """Machine-readable line for the Prefect task (rank 0 only; tasks/core/run/events.py)."""
    if dist.get_rank() == 0:
        print(format_event(kind, record), flush=True)


class Engine:
    """Plugin, booster and the boosted model/optimizer/scheduler of one stage on this rank."""

    def __init__(self, job: Job, faults: Injector):
        from colossalai.booster import Booster

        self.job, self.faults = job, faults
        self.cfg = job.phase_cfg
        self.pcfg = self.cfg.plugin
        self.spec = spec_of(self.pcfg.name)
        from colossalai.accelerator import get_accelerator

        self.device = get_accelerator().get_current_device()
        # Each kernel the registry has on is tried on this device first; the plugin gets those that load.
        self.kernels = accel.load_kernels(
            self.cfg, job.phase, job.model_dir, torch.cuda.is_available(), self.device, dist.get_rank()
        )
        self.activation_checkpointing = False
        # what a policy row's family needs under a plugin that shards with its policy (policy_rows.shard_settings):
        # the attention implementation the model is built with, the shardformer flags the plugin gets
        model_type = accel.model_type(job.model_dir)
        self.policy_model_kwargs, flags = shard_settings(model_type) if self.spec.shardformer else ({}, {})
        self.batch_mask = self.spec.shardformer and needs_attention_mask(model_type)  # GPT-2's forward reads one
        if self.policy_model_kwargs or flags:
            log(f"{model_type}'s policy row: model {self.policy_model_kwargs}, plugin {flags}", detail=True)
        for name, state in self.kernels.items():  # a kernel the row switches on is recorded on (manifests, card)
            if state.spec.via == "plugin" and not state.on and flags.get(state.spec.arg, None) == state.spec.value:
                self.kernels[name] = KernelState(
                    state.spec, True, f"on ({state.spec.label}; {model_type}'s policy needs it)"
                )
        self.plugin = make_plugin(self.pcfg, self.cfg, phase=job.phase, kernels=self.kernels, model_type=model_type)
        self.layout = layout_of(self.plugin, self.pcfg)
        self.booster = Booster(plugin=self.plugin, mixed_precision=booster_mixed_precision(self.pcfg))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # Which node each rank runs on, for the manifests (node_staging.node_name: Slurm's name
        # for its, possibly emulated, node, else the host name).
        self.rank_nodes: list[str] = [""] * self.world
        dist.all_gather_object(self.rank_nodes, node_staging.node_name())
        self.autocast = uses_autocast(self.pcfg)
        self.model = self.optimizer = self.scheduler = None
        self.config = None
        self.clip_norm = None
        self.notice_agreed = False  # some rank holds a preemption notice (reduce_loss)
        self.save_s: float | None = None  # how long this launch's last save took
        self.pending_weights: Path | None = None  # an HF folder a lazily built model still has to read
        # LoRA (tasks/engine/lora.py) wraps the whole HF model in peft before boost: never built lazily; nor a family
        # whose modules keep plain tensors LazyInitContext leaves on the meta device (PolicyRow.eager_build: GPT-J).
        self.lazy_init = self.spec.lazy_init and self.cfg.lora is None and lazy_init_safe(model_type)
        self.lora_meta = None
        # A pair phase (DPO): each micro-batch's loss is the pair loss of one forward (tasks/engine/pairs.py),
        # and each step's preference figures (accuracy, margin) ride the loss all-reduce (`pair_metrics`).
        self.pair_loss = None
        self.pair_metrics: dict[str, float] | None = None

    # -- model ------------------------------------------------------------------------------

    def load_pretrained(self) -> torch.nn.Module:
        """The HF model with its weights (safetensors only), in the dtype the plugin trains it in
        (`build_dtype`), so a bf16 rank never holds an fp32 copy of the whole model on the way.

        A plugin that shards a lazily built model as it materializes it (`PluginSpec.lazy_init`)
        gets the architecture only, built lazily; `load_pending_weights` then reads the weights
        into the boosted, sharded model, so no rank ever holds the whole model."""
        from transformers import AutoModelForCausalLM

        if self.lazy_init:
            model = self.from_config()
            self.pending_weights = self.job.model_dir
            return model

        def build(**kernels):  # attn_implementation where a kernel is on (accel.load_model)
            return AutoModelForCausalLM.from_pretrained(
                str(self.job.model_dir),
                config=self.hf_config(),
                dtype=self.build_dtype,
                use_safetensors=True,
                trust_remote_code=self.job.trust_remote_code,
                output_loading_info=True,
                **kernels,
                **self.policy_model_kwargs,
            )

        self.kernels, (model, info) = accel.load_model(self.kernels, build, self.rank)
        problems = {k: v for k, v in info.items() if v}
        if problems:
            raise ManifestError(f"{self.job.model_dir}: weights do not match the model's config: {problems}")
        self.config = model.config
        return model

    def from_config(self) -> torch.nn.Module:
        """Architecture only (weights come from the checkpoint): model_dir's config.json; built
        lazily (ColossalAI's LazyInitContext) where the plugin materializes it shard by shard."""
        from transformers import AutoModelForCausalLM

        self.config = self.hf_config()
        with self._construction():
            self.kernels, model = accel.load_model(
                self.kernels,
                # a copy per try: transformers >= 4.52 writes the refused attn_implementation into the config it
                # is given, and the fallback build would ask for it again
                lambda **kernels: AutoModelForCausalLM.from_config(
                    copy.deepcopy(self.config),
                    dtype=self.build_dtype,
                    trust_remote_code=self.job.trust_remote_code,
                    **kernels,
                    **self.policy_model_kwargs,
                ),
                self.rank,
            )
        self.config = model.config
        return model

    def hf_config(self):
        """model_dir's config.json with the stage's context settings (`cpt.context`: RoPE, positions)
        in place, built by its config class as from config.json, so every checkpoint's config.json has them."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(self.job.model_dir), trust_remote_code=self.job.trust_remote_code)
        changes = config_changes(self.cfg.context)
        if not changes:
            return config
        log(f"model config: {'; '.join(changes_text(config.to_dict(), self.cfg.context))} (cpt.context)", detail=True)
        return type(config).from_dict({**config.to_dict(), **changes})

    @property
    def build_dtype(self) -> torch.dtype:
        """A plugin that casts the model (low_level_zero, gemini) casts every weight to its
        precision and derives its fp32 masters from the cast weights (LowLevelZeroOptimizer after
        LowLevelZeroModel's cast; GeminiDDP's fp32_p = p.clone().float() after p.to(bf16)), so
        building in that dtype is the same model at a third of the peak (2 bytes a parameter, not
        4 + 2). A lazily built model stays fp32 until shardformer materializes one layer at a time."""
        return torch.float32 if self.lazy_init else _DTYPES[self.weights_dtype]

    def _construction(self):
        if not self.lazy_init:
            return contextlib.nullcontext()
        from colossalai.lazy import LazyInitContext

        return LazyInitContext(default_device=self.device)

    def load_pending_weights(self) -> None:
        """The HF weights of a lazily built model, read into the boosted, sharded model one tensor at
        a time (tasks/engine/weights.py); strict, so a tensor the model holds that the files lack, or
        one of the wrong shape, fails here, naming the folder."""
        if self.pending_weights is None:
            return
        src, self.pending_weights, t0 = Path(self.pending_weights), None, time.monotonic()
        got = self.read_weights(src)
        log(
            detail=True,
            msg=f"built lazily and sharded under {self.pcfg.name}; read {got.tensors} tensors of {src} ({got.files} "
            "file(s), "
            f"the largest {got.largest / 2**20:.1f} MiB) into this rank's share in {time.monotonic() - t0:.1f}s",
        )

    def read_weights(self, src: Path) -> weights.Loaded:
        got = weights.read_into(self.model.unwrap(), src, self.config.to_dict())
        self.model.update_master_params()
        return got

    def boost(self, model: torch.nn.Module) -> None:
        cfg = self.cfg
        check_model(self.cfg, model.config.to_dict(), self.job.phase)
        model.train()
        if not self.spec.dedupes_tied_weights and getattr(model.config, "tie_word_embeddings", False):
            weights.save_tied_once(model)
        self.activation_checkpointing = accel.checkpoint_activations(
            model, cfg, self.job.phase
        )  # before the plugin wraps it
        optimizer = make_optimizer(model, cfg, self.pcfg.name, **accel.optimizer_kwargs(self.kernels))
        scheduler = make_scheduler(optimizer, cfg)
        self.model, self.optimizer, _, _, self.scheduler = self.booster.boost(model, optimizer, lr_scheduler=scheduler)
        accel.announce(self.kernels, self.activation_checkpointing, self.rank)

    def materialize_optimizer_state(self) -> None:
        """Create AdamW's zero state now instead of at the first step.

        step-000000 must hold an optimizer checkpoint, and ColossalAI's ZeRO optimizer cannot
        save one before the state exists (KeyError in `state_dict_shard`). The values mirror
        torch's lazy init in `Adam._init_group` (step 0.0 on CPU, zero moments shaped like the
        parameters the optimizer actually steps: master shards under ZeRO), so the first step
        after loading is the same as a first step from scratch.
        """
        inner = getattr(self.optimizer, "optim", self.optimizer)
        if isinstance(inner, torch.optim.AdamW):
            try:
                from torch.optim.optimizer import _get_scalar_dtype

                zero_step = lambda: torch.tensor(0.0, dtype=_get_scalar_dtype())
            except ImportError:  # private helper; float32 is its answer for the default dtype
                zero_step = lambda: torch.tensor(0.0, dtype=torch.float32)
        else:  # ColossalAI's HybridAdam (Gemini) starts its counter at the int 0
            zero_step = lambda: 0
        # Gemini: the optimizer's params are empty placeholders outside step(); each stands for the
        # fp32 range [begin, end) of its chunk that this rank updates (GeminiOptimizer.param_to_range),
        # and HybridAdam's own lazy init makes 1-D fp32 moments of that size on the chunk's device.
        # Moments shaped like the empty placeholder fail the save (pack_optimizer_states_to_tensor
        # asserts numel == shard size) and the first step (multi_tensor_adam: Size mismatch).
        ranges = getattr(self.optimizer, "param_to_range", None)
        for group in inner.param_groups:
            if group.get("amsgrad") or group.get("capturable"):
                raise ValueError("materialize_optimizer_state mirrors AdamW without amsgrad/capturable only")
            for p in group["params"]:
                state = inner.state[p]
                if len(state) == 0:
                    # fused AdamW keeps its step on the parameter's device in float32 (torch's _init_group)
                    state["step"] = (
                        torch.zeros((), dtype=torch.float32, device=p.device) if group.get("fused") else zero_step()
                    )
                    if ranges is not None and p in ranges:
                        begin, end = ranges[p]
                        state["exp_avg"] = torch.zeros(end - begin, dtype=torch.float32, device=p.device)
                        state["exp_avg_sq"] = torch.zeros(end - begin, dtype=torch.float32, device=p.device)
                        if hasattr(inner, "_post_state_init"):  # what HybridAdam's lazy init does next
                            inner._post_state_init(p)
                        continue
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def layout_record(self) -> dict[str, Any]:
        """How this stage runs now (tasks/core/run/segments.py): in every manifest and segment."""
        return segments.record(
            plugin_meta(self.pcfg, self.cfg),
            self.world,
            self.layout.dp_size,
            self.cfg.micro_batch_size,
            self.cfg.grad_accum_steps,
        )

    @property
    def weights_dtype(self) -> str:
        # A plugin that does not cast the model (torch_ddp) keeps fp32 weights under autocast.
        return self.spec.weights_dtype(self.pcfg.precision)

    # -- one optimizer step -----------------------------------------------------------------

    def train_step(self, micro: list[dict[str, torch.Tensor]], noticed: Callable[[], bool] | None = None) -> float:
        """One optimizer step over this rank's micro-batches (`StageData.next_batch`: each padded
        to its own width; a pipeline gets one batch, which its schedule splits). `noticed`, read
        at the step's end, rides the loss all-reduce: `notice_agreed` is then the same on every rank."""
        model, optimizer, booster = self.model, self.optimizer, self.booster
        # Packed rows (sft batching `packed`): their segment ids become the attention this model's
        # implementation needs; the mask is built in the dtype the attention computes in.
        compute = self.autocast or _DTYPES[self.weights_dtype]
        impl = getattr(self.config, "_attn_implementation", "eager")
        micro = [model_inputs({k: v.to(self.device) for k, v in mb.items()}, impl, compute) for mb in micro]
        if self.batch_mask:  # a CPT block has no mask: all ones is no mask to transformers
            micro = [{"attention_mask": torch.ones_like(mb["input_ids"]), **mb} for mb in micro]
        pairs = self._pair_loss()
        sums = [0.0] * len(PAIR_SUMS) if pairs else None
        if self.pcfg.pp_size > 1:
            out = booster.execute_pipeline(
                iter(micro),
                model,
                lambda outputs, inputs: outputs.loss,
                optimizer,
                return_loss=True,
                return_outputs=False,
            )
            local = out["loss"].detach().double() if self.layout.is_last_stage else None
        else:
            ga = len(micro)
            local = torch.zeros((), dtype=torch.float64, device=self.device)
            for i, mb in enumerate(micro):
                skip_sync = i < ga - 1 and can_no_sync(self.pcfg)
                sync_ctx = booster.no_sync(model, optimizer) if skip_sync else contextlib.nullcontext()
                with sync_ctx:
                    cast = (
                        torch.autocast(device_type=_device_type(), dtype=self.autocast)
                        if self.autocast
                        else contextlib.nullcontext()
                    )
                    if pairs:  # the forward under the cast, the log-softmax and the pair loss in fp32
                        with cast:
                            logits = pairs.forward(model, mb)
                        out = pairs.step(logits, mb)
                        loss, sums = out.loss, add_pair_sums(sums, out)
                    else:
                        with cast:
                            loss = model(**mb, use_cache=False).loss
                    booster.backward(loss / ga, optimizer)
                local += loss.detach().double()
            local = local / ga
        # A plugin whose optimizer wrapper keeps no grad norm (torch_ddp): the clip call returns it.
        self.clip_norm = None
        if not self.spec.clips_grad and self.pcfg.max_norm > 0:
            self.clip_norm = optimizer.clip_grad_by_norm(self.pcfg.max_norm)
        optimizer.step()
        optimizer.zero_grad()
        self.scheduler.step()
        return self.reduce_loss(local if self.layout.holds_loss else None, bool(noticed and noticed()), sums)

    def _pair_loss(self):
        if self.pair_loss is None and PHASES[self.job.phase].record == "pair":
            self.pair_loss = PairLoss(self.cfg, self.config.vocab_size, self.layout.tp_group)
        return self.pair_loss

    def reduce_loss(self, local: torch.Tensor | None, noticed: bool = False, sums: list[float] | None = None) -> float:
        """The step's loss averaged over data-parallel replicas; the second element counts the ranks
        that hold a preemption notice (the one collective every step has: no extra round trip). A pair
        phase's additive preference sums ride along: `pair_metrics` is their `metrics` over every replica."""
        n = len(sums) if sums is not None else 0
        t = torch.zeros(2 + n, dtype=torch.float64, device=self.device)  # NCCL reduces device tensors only
        if local is not None:
            t[0] += local
            if n:
                t[2:] += torch.tensor(sums, dtype=torch.float64, device=self.device)
        t[1] = float(noticed)
        dist.all_reduce(t)
        self.notice_agreed = bool(t[1].item() > 0)
        if n:
            self.pair_metrics = preference_metrics(dict(zip(PAIR_SUMS, t[2:].tolist())))
        return float(t[0].item() / self.layout.dp_size)

    # -- fingerprint --------------------------------------------------------------------------

    def fingerprint(self, model_dir: Path) -> torch.Tensor | None:
        """Probe logits (fp32 tensor on rank 0, None elsewhere); collective for pp == 1."""
        vocab = self.config.vocab_size
        if self.pcfg.pp_size > 1:
            dist.barrier()
            if self.rank != 0:
                return None
            return hf_dir_logits(
                model_dir,
                dtype=self.weights_dtype,
                trust_remote_code=self.job.trust_remote_code,
                verify_memory_gb=self.job.verify_memory_gb,
                say=log,
            )
        logits = _live_logits(self.model, vocab, self.layout.tp_group, as_trained=self.batch_mask)
        return logits if self.rank == 0 else None

    # -- checkpoints --------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any]) -> Path:
        job, rank = self.job, self.rank
        stage_dir = job.stage_dir
        tmp, final = stage_dir / ckpt.tmp_name(step), stage_dir / ckpt.step_name(step)
        if job.remote_run_root and step > 0:
            wait_for_publishes(stage_dir, step, self.cfg.max_pending_publishes, self.cfg.keep_last, log, emit)
        t0 = time.monotonic()
        # With per-node staging every node writes its parts into its own directory.
        if rank == 0 or (job.nodes is not None and node_staging.local_rank() == 0):
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        part = lambda name: self.faults.before_save_part(step, name)
        part("model")
        mib = ckpt.save_shard_mib(
            self.config.to_dict(), _DTYPES[self.weights_dtype].itemsize
        )  # bounds the save's gathered tensors
        with hostmem.large_blocks_mapped():  # the gathered blocks go back to the OS once written
            if (
                self.cfg.lora is not None
            ):  # the adapter only: the base stays the job's model_dir, referenced in the meta
                lora.save_adapter(self.booster, self.model, tmp / lora.ADAPTER)
            else:
                self.booster.save_model(
                    self.model, str(tmp / "model"), shard=True, use_safetensors=True, size_per_shard=mib
                )
            part("optimizer")
            self.booster.save_optimizer(self.optimizer, str(tmp / "optimizer"), shard=True, size_per_shard=mib)
            kept = masters.save(self, tmp / MASTERS)  # fp32 masters of a mixed-precision stage; every piece's place
        part("lr_scheduler")
        self.booster.save_lr_scheduler(self.scheduler, str(tmp / "lr_scheduler.pt"))
        part("rng")
        # Each rank writes its own generator state: its part of the checkpoint, on its own node.
        ckpt.write_rng(tmp / "rng", rank, ckpt.capture_rng())
        part("fingerprint")
        logits = self.fingerprint(tmp / "model")
        part("state")
        if rank == 0:
            fp = save_fingerprint(logits, tmp, dtype=self.weights_dtype)
            ckpt.write_json(tmp / ckpt.TRAIN_STATE, state)
        dist.barrier()  # every rank's files are on disk before the manifest covers them
        elsewhere = node_staging.publish_parts(job, tmp, final.name) if job.nodes is not None else {}
        part("manifest")
        if rank == 0:
            losses = state["losses"]
            meta = {
                "phase": job.phase,
                "step": step,
                "max_steps": self.cfg.max_steps,
                "plugin": plugin_meta(self.pcfg, self.cfg),
                "world_size": self.world,
                "layout": self.layout_record(),
                "nodes": sorted(set(self.rank_nodes)),
                "rank_nodes": self.rank_nodes,
                "dp_size": self.layout.dp_size,
                "weights_dtype": self.weights_dtype,
                "tokens_seen": state["tokens_seen"],
                "final_loss": losses[-1] if losses else None,
                "lr": state["lr"],
                "model_type": getattr(self.config, "model_type", None),
                "vocab_size": self.config.vocab_size,
                "architectures": getattr(self.config, "architectures", None),
                "model_format": "hf-safetensors-sharded",
                "optimizer": type(getattr(self.optimizer, "optim", self.optimizer)).__name__,
                # What ran, not what was asked: each kernel's reason (a failed load included).
                "kernels": kernel_record(self.kernels),
                "activation_checkpointing": self.activation_checkpointing,
                "masters": kept,  # fp32: whether the fp32 master weights are saved (a resume restores them)
                **({"lora": self.lora_meta} if self.lora_meta else {}),
            }
            parent = job.parent.model_dump() if job.parent is not None else None
            write_manifest(
                tmp,
                kind=ckpt.KIND,
                meta=meta,
                parent=parent,
                config_digest=job.config_digest,
                fingerprint=fp,
                other_files=elsewhere,
            )
            part("rename")
            ckpt.commit(tmp, final)
            if job.nodes is not None:
                node_staging.publish_manifest(job, final)
        elif job.nodes is not None and node_staging.local_rank() == 0:
            ckpt.commit(tmp, final)  # this node's parts, kept for nothing but a look: resume re-stages
        dist.barrier()  # nobody reads step-N (or deletes older ones) before it is committed
        self.save_s = time.monotonic() - t0
        if rank == 0:
            log(f"checkpoint {final.name} committed in {self.save_s:.1f}s")
            emit(CHECKPOINT, {"step": step, "path": str(final)})
            if step > 0:
                removed = ckpt.retain(stage_dir, self.cfg.keep_last, require_published=job.remote_run_root)
                if removed:
                    log(f"retention keep_last={self.cfg.keep_last}: removed {', '.join(removed)}", detail=True)
        return final

    def load(self, path: Path) -> None:
        model_dir = path / "model"
        # Under LoRA the weights are already in place: enable_lora (lora.enable) read the adapter
        # onto the job's base, so only the optimizer, the scheduler and the data position load here.
        if self.cfg.lora is None and self.lazy_init:  # the checkpoint's blocks, one tensor at a time
            self.read_weights(model_dir)
        elif self.cfg.lora is None and self.spec.strict_load:
            self.booster.load_model(self.model, str(model_dir))
        elif self.cfg.lora is None:
            # ColossalAI's general loader in strict mode demands a tied LM head that HF (and
            # weights.save_tied_once) leave out; load non-strict and check the key set exactly here.
            index = json.loads((model_dir / "model.safetensors.index.json").read_text())
            want, have = set(self.model.unwrap().state_dict()), set(index["weight_map"])
            if want != have:
                raise ManifestError(
                    f"{model_dir}: checkpoint keys do not match the model: missing {sorted(want - have)[:5]}, "
                    f"unexpected {sorted(have - want)[:5]}"
                )
            self.booster.load_model(self.model, str(model_dir), strict=False)
        # AdamW's state read as this rank's pieces (else ColossalAI's loader), then the fp32 masters over
        # the ones ColossalAI rebuilt from the working weights, through one view of the checkpoint
        held = masters.collect(self)
        view = CheckpointState(path) if any((path / MASTERS).glob("rank-*.json")) else None
        try:
            said = state_read.load_optimizer(self, path, view, held) if view is not None else ""
            if not said:
                self.booster.load_optimizer(self.optimizer, str(path / "optimizer"))
            for line in (said, masters.restore(self, path, held=held, view=view)):
                if line:
                    log(line)
        finally:
            if view is not None:
                view.close()
        self.booster.load_lr_scheduler(self.scheduler, str(path / "lr_scheduler.pt"))
        masters.dump_loaded(self, path)


def _device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@torch.no_grad()
def _live_logits(model, vocab_size: int, tp_group, as_trained: bool = False) -> torch.Tensor:
    # as_trained (mask, labels) for a policy that reads both (GPT-2's forward fails without them; probe_forward)
    if tp_group is None:
        return model_logits(model, vocab_size, as_trained=as_trained)
    # Tensor parallel: the LM head keeps its vocab shard (parallel_output); gather along vocab.
    logits = probe_forward(model, vocab_size, as_trained=as_trained)
    if logits.shape[-1] < vocab_size:
        parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(tp_group))]
        dist.all_gather(parts, logits, group=tp_group)
        logits = torch.cat(parts, dim=-1)
    return logits[..., :vocab_size].float().cpu()
