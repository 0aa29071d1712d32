"""Pre-flight: every check a run can fail in seconds, before a model is loaded or a rank started.

    python -m flows.cpt_to_sft --config deployments/configs/tiny-cpu.yaml --check

Pure of prefect: the Prefect task (`tasks.preflight.preflight`) adds the one check that needs it
(the Hub token in the Secret block `hf-token`) and passes its answer in as `token_present`.
Nothing here reads weights: the base model's config.json, tokenizer_config.json and file list
are enough (for a Hub repo: `hf_hub_download` of those two small files and the repo's file list).

Every check appends to one report; a problem is (config field or file, message with the fix).
All of them are reported together in one `ConfigError`; a clean run returns the report, whose
`checked` lines say what was verified. Machine facts (GPUs, CPUs, free disk) and the token
answer are parameters, so tests inject them instead of needing the machine.

Decisions recorded here:
- vocab_size not divisible by tp_size is REFUSED for hybrid_parallel with tp > 1. ColossalAI
  0.5.0 would pad the embedding and LM head (`make_vocab_size_divisible_by`), and although the
  model save strips the padding (`to_unpadded_tensor`), saving the optimizer state of a padded
  parameter fails (AssertionError in `search_tp_partition_dim`, measured here). The engine turns
  padding off (`make_vocab_size_divisible_by=1`), so the export always holds exactly
  `vocab_size` rows and `tasks.core.convert` refuses any padded row it finds. Choose a tp_size
  that divides the vocabulary (or resize the vocabulary to a multiple of it) instead.
- pp must be <= num_hidden_layers, not a divisor of it: ColossalAI's stage manager distributes
  layers unevenly.
- Staging space is an estimate (dense decoder parameter count from config.json): a training
  checkpoint is weights in the training precision + fp32 Adam moments (8 B/param) + fp32 master
  weights when training in bf16/fp16 (4 B/param); a local run root keeps `keep_last + 1` of them
  per stage at once (the new one is committed before the oldest is deleted), plus the three HF
  copies (base, cpt/hf, export). A remote run root stages at most two checkpoints of one stage.
"""

from __future__ import annotations

import itertools

import json
import math
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from fsspec.core import url_to_fs

from tasks.core.config import RunConfig, StageConfig, parse_config, plugin_problems, read_raw_config
from tasks.core.hub import is_hub_id
from tasks.core.layout import layout_problems
from tasks.core.paths import REPO_ROOT, resolve_local
from tasks.core.errors import ConfigError, ManifestError
from tasks.core.manifest import MANIFEST, _inside, safe_relpath
from tasks.core.storage import is_local

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl")
HEAD_RECORDS = 64  # records parsed per dataset: enough to catch a wrong format, cheap on any size
DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}
ADAM_BYTES = 8  # exp_avg + exp_avg_sq, fp32
MASTER_BYTES = 4  # fp32 master weights kept by mixed-precision optimizers

Problem = tuple[str, str]


# --------------------------------------------------------------------------------------------
# What a check sees


@dataclass(frozen=True)
class Machine:
    """Facts about this machine; `detect()` reads them, tests pass their own."""

    cuda_devices: int
    cpu_count: int
    free_bytes: int | None = None  # None: shutil.disk_usage of the staging location

    @classmethod
    def detect(cls) -> "Machine":
        import torch  # lazily: config-only callers should not pay for it

        return cls(cuda_devices=torch.cuda.device_count() if torch.cuda.is_available() else 0, cpu_count=os.cpu_count() or 1)


@dataclass
class ModelInfo:
    """What pre-flight reads of the base model: no weights."""

    source: str  # "local", "fsspec" or "hub"
    where: str  # the resolved path/URI or repo@revision, for messages
    config: dict[str, Any]
    files: list[str]  # top-level file names
    tokenizer_config: dict[str, Any] | None = None
    chat_template_file: bool = False  # chat_template.jinja / chat_template.json beside the tokenizer


@dataclass
class PreflightReport:
    checked: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def error(self) -> ConfigError:
        return ConfigError(self.problems, header="pre-flight failed, nothing was launched")

    def raise_for_problems(self) -> "PreflightReport":
        if self.problems:
            raise self.error()
        return self

    def text(self) -> str:
        lines = [str(self.error())] if self.problems else [f"pre-flight passed in {self.seconds:.2f} s ({len(self.checked)} checks)"]
        if self.warnings:
            lines.append(f"warnings ({len(self.warnings)}):")
            lines += [f"  ! {w}" for w in self.warnings]
        lines.append("checked:" if self.ok else "checked (passed or not reached):")
        lines += [f"  ✓ {c}" for c in self.checked]
        return "\n".join(lines)


@dataclass
class _Ctx:
    cfg: RunConfig
    machine: Machine
    token_present: bool | None
    model: ModelInfo | None
    report: PreflightReport

    def problem(self, where: str, msg: str) -> None:
        if (where, msg) not in self.report.problems:
            self.report.problems.append((where, msg))

    def ok(self, line: str) -> None:
        self.report.checked.append(line)

    def warn(self, line: str) -> None:
        self.report.warnings.append(line)


# --------------------------------------------------------------------------------------------
# Loading the config without stopping at the first kind of problem


class _Unchecked(RunConfig):
    """RunConfig minus its static-rule validator: pre-flight runs those rules itself, so a
    wrong ZeRO precision and a missing data file are reported in the same message."""

    def _static_rules(self) -> "_Unchecked":  # overrides the parent's model_validator
        return self


def load_for_check(path: str | Path, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Read a local YAML config like `load_config`, deferring the static rules to pre-flight.

    Structural problems (unknown or missing fields, wrong types) still raise `ConfigError`
    here: nothing else can be checked without a well-formed config.
    """
    raw = read_raw_config(path, overrides)
    try:
        return _Unchecked.model_validate(raw)
    except Exception:
        return parse_config(raw, source=str(path))  # raises ConfigError naming every field


# --------------------------------------------------------------------------------------------
# Reading the base model's metadata


def read_model_info(uri: str, revision: str = "main") -> ModelInfo:
    """config.json, tokenizer_config.json and the file list of a local/fsspec dir or Hub repo.

    Raises ConfigError naming `base_model.uri` when there is no readable config.json.
    """
    if is_hub_id(uri):
        return _read_hub(uri, revision)
    target = resolve_local(uri)
    try:
        fs, root = url_to_fs(target)
    except (ValueError, ImportError) as exc:
        raise ConfigError([("base_model.uri", f"{uri}: cannot open ({exc}); use a local path, an fsspec URI with its filesystem installed, or a Hub id org/name")]) from None
    root = root.rstrip("/")
    try:
        has_config = fs.isfile(f"{root}/config.json")
    except Exception as exc:  # network filesystems raise their own errors
        raise ConfigError([("base_model.uri", f"{uri}: not reachable ({type(exc).__name__}: {exc})")]) from None
    if not has_config:
        what = "does not exist" if not fs.exists(root) else "is not an HF model directory (no config.json)"
        raise ConfigError([("base_model.uri", f"{target} {what}; point base_model.uri at an HF model directory or a Hub id org/name (for the demo: `python -m tasks.core.demo_inputs --out {uri}`)")])

    def read_json(name: str) -> dict | None:
        path = f"{root}/{name}"
        if not fs.isfile(path):
            return None
        try:
            with fs.open(path, "rb") as f:
                data = json.loads(f.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError([("base_model.uri", f"{target}/{name} is not valid JSON ({exc})")]) from None
        return data if isinstance(data, dict) else None

    config = read_json("config.json") or {}
    files = sorted(Path(p.rstrip("/")).name for p in fs.ls(root, detail=False))
    return ModelInfo(
        source="local" if is_local(target) else "fsspec",
        where=target,
        config=config,
        files=files,
        tokenizer_config=read_json("tokenizer_config.json"),
        chat_template_file=any(n in files for n in ("chat_template.jinja", "chat_template.json")),
    )


def _read_hub(repo: str, revision: str) -> ModelInfo:
    from huggingface_hub import HfApi, hf_hub_download

    def fetch(name: str) -> dict | None:
        try:
            with open(hf_hub_download(repo, name, revision=revision)) as f:
                return json.load(f)
        except Exception as exc:
            if name == "config.json":
                raise ConfigError([("base_model.uri", f"cannot read config.json of Hub repo {repo}@{revision} ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); check the id and revision, the network, and HF_TOKEN for gated repos")]) from None
            return None

    config = fetch("config.json") or {}
    try:
        files = sorted(f for f in HfApi().list_repo_files(repo, revision=revision) if "/" not in f)
    except Exception as exc:
        raise ConfigError([("base_model.uri", f"cannot list the files of Hub repo {repo}@{revision} ({type(exc).__name__})")]) from None
    return ModelInfo(
        source="hub",
        where=f"{repo}@{revision}",
        config=config,
        files=files,
        tokenizer_config=fetch("tokenizer_config.json") if "tokenizer_config.json" in files else None,
        chat_template_file=any(n in files for n in ("chat_template.jinja", "chat_template.json")),
    )


def estimate_parameters(mc: dict[str, Any]) -> int | None:
    """Parameter count from config.json through its family's tensor table (`tasks.core.families`),
    the table the converter checks checkpoints against; None for an unknown family or missing dims."""
    from tasks.core.errors import ConversionError
    from tasks.core.families import count_parameters

    try:
        return count_parameters(mc)
    except (ConversionError, KeyError, TypeError, ValueError):
        return None


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n} B"


# --------------------------------------------------------------------------------------------
# Checks: each takes the context and records problems, warnings and what it verified.


def check_static_rules(ctx: _Ctx) -> None:
    """The config's own rules (ZeRO needs bf16/fp16, tp/pp need hybrid_parallel, world size)."""
    before = len(ctx.report.problems)
    for stage in ("cpt", "sft"):
        for where, msg in plugin_problems(getattr(ctx.cfg, stage), stage):
            ctx.problem(where, msg)
    if len(ctx.report.problems) == before:
        ctx.ok("static config rules: plugin/ZeRO/precision combinations, world size multiple of tp*pp, pipeline micro-batches >= pp")


def _stage_layout(ctx: _Ctx, name: str, stage: StageConfig) -> None:
    """The model and batch rules of `tasks.core.layout` (the static ones ran in check_static_rules)."""
    p, launch = stage.plugin, stage.launch
    mc = ctx.model.config if ctx.model else None
    if mc is not None and p.tp_size > 1 and not isinstance(mc.get("num_attention_heads"), int):
        ctx.warn(f"{name}.plugin.tp_size: config.json has no num_attention_heads; tensor-parallel divisibility not checked")
    for where, msg in layout_problems(stage, name, model_config=mc, tiers=("batch", "model")):
        ctx.problem(where, msg)
    world = launch.world_size
    if world % (p.tp_size * p.pp_size) == 0 and not any(where.startswith(f"{name}.") for where, _ in ctx.report.problems):
        dp = world // (p.tp_size * p.pp_size)
        heads = f", divides {mc.get('num_attention_heads')} heads / {mc.get('num_key_value_heads') or mc.get('num_attention_heads')} KV heads" if mc and p.tp_size > 1 else ""
        layers = f", {mc.get('num_hidden_layers')} layers" if mc and p.pp_size > 1 else ""
        ctx.ok(f"{name} layout: {p.name} tp={p.tp_size}{heads} · pp={p.pp_size}{layers} · dp={dp} = {launch.nnodes} node(s) x {launch.nproc_per_node} = {world} ranks, {p.precision}, zero_stage {p.zero_stage}")


def check_layout(ctx: _Ctx) -> None:
    """tp divides the attention and KV heads; pp <= layers; tp*pp*dp = world; pipeline batches."""
    for name in ("cpt", "sft"):
        _stage_layout(ctx, name, getattr(ctx.cfg, name))
    if ctx.model is None:
        ctx.warn("layout against the base model not checked: its config.json could not be read (see problems)")


def check_machine(ctx: _Ctx) -> None:
    """Processes vs visible GPUs (or CPU cores); plugins that need CUDA."""
    m = ctx.machine
    for name in ("cpt", "sft"):
        stage = getattr(ctx.cfg, name)
        n = stage.launch.nproc_per_node
        for where, msg in layout_problems(stage, name, cuda=bool(m.cuda_devices), tiers=("device",)):
            ctx.problem(where, msg)
        if m.cuda_devices:
            if n > m.cuda_devices:
                ctx.problem(f"{name}.launch.nproc_per_node", f"{n} processes per node requested but {m.cuda_devices} GPU(s) are visible (CUDA_VISIBLE_DEVICES); set nproc_per_node <= {m.cuda_devices}")
            else:
                ctx.ok(f"{name} processes: {n} per node <= {m.cuda_devices} visible GPU(s)")
        elif n > m.cpu_count:
            ctx.warn(f"{name}.launch.nproc_per_node: {n} CPU ranks on {m.cpu_count} core(s) oversubscribes the CPU; it runs, slowly")
        else:
            ctx.ok(f"{name} processes: {n} CPU rank(s) (gloo) on {m.cpu_count} core(s), no GPU visible")


def check_run_root(ctx: _Ctx) -> None:
    """The run root is reachable and writable: write, read back and delete a probe object."""
    from tasks.core.storage import RunStore

    uri = ctx.cfg.run_uri
    probe = f".preflight-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        store = RunStore(uri, staging_dir=ctx.cfg.staging_dir)
    except (ValueError, ImportError) as exc:
        ctx.problem("run_root", f"{uri}: not reachable ({type(exc).__name__}: {exc}); use a local path or an fsspec URI whose filesystem is installed (s3:// needs s3fs)")
        return
    try:
        store.write_text(probe, "cpt-to-sft pre-flight probe\n")
        if store.read_text(probe) != "cpt-to-sft pre-flight probe\n":
            raise OSError("the probe read back differently")
        store.remove(probe)
    except Exception as exc:
        ctx.problem("run_root", f"{uri}: not writable ({type(exc).__name__}: {exc}); point run_root at a directory this worker can create files in")
        return
    ctx.ok(f"run root {uri}: reachable, probe object written, read back and deleted")
    _check_existing_manifests(ctx, store)


def _check_existing_manifests(ctx: _Ctx, store: Any) -> None:
    """Artifacts already under the run root (a resume) are untrusted: every manifest path must
    stay inside its artifact. Only names and link targets are read here, never file contents."""
    fs, root = store.fs, store.root.rstrip("/")
    found = []
    for depth in ("*", "*/*"):
        try:
            found += fs.glob(f"{root}/{depth}/{MANIFEST}")
        except Exception:
            pass
    bad = 0
    for mpath in sorted(set(found)):
        art = mpath.rsplit("/", 1)[0]
        rel_art = art[len(root) + 1 :]
        where = f"{store.uri(rel_art)}/{MANIFEST}"
        try:
            with fs.open(mpath, "rb") as f:
                manifest = json.loads(f.read())
        except Exception as exc:
            ctx.warn(f"{where}: unreadable manifest ({type(exc).__name__}); that stage will be rebuilt")
            continue
        files = manifest.get("files") if isinstance(manifest, dict) else None
        if not isinstance(files, dict):
            ctx.warn(f"{where}: manifest has no files table; that stage will be rebuilt")
            continue
        for rel in files:
            try:
                safe_relpath(rel, where)
                if store.local:
                    _inside(Path(art), rel, where)
            except ManifestError as exc:
                bad += 1
                ctx.problem(where, f"{str(exc).removeprefix(where + ': ')}. Refusing to trust this artifact: move it aside or delete {store.uri(rel_art)}")
                break
    if found and not bad:
        ctx.ok(f"existing artifacts under the run root: {len(found)} manifest(s), every listed path stays inside its artifact")


def estimate_local_bytes(cfg: RunConfig, mc: dict[str, Any], local_run_root: bool) -> tuple[int, str] | None:
    """(bytes of local disk the run needs, how it was computed), or None without model dims."""
    n = estimate_parameters(mc)
    if n is None:
        return None
    base_bytes = DTYPE_BYTES.get(str(mc.get("torch_dtype", "float32")), 4)

    def ckpt(stage: StageConfig) -> int:
        w = DTYPE_BYTES[stage.plugin.precision]
        return n * (w + ADAM_BYTES + (MASTER_BYTES if w < 4 else 0))

    hf = n * (base_bytes + DTYPE_BYTES[cfg.cpt.plugin.precision] + DTYPE_BYTES[cfg.export.dtype])
    if local_run_root:
        kept = sum((getattr(cfg, s).keep_last + 1) * ckpt(getattr(cfg, s)) for s in ("cpt", "sft"))
        how = f"{n / 1e6:.1f}M params: (keep_last+1) checkpoints per stage at (weights + 8 B Adam + 4 B master if mixed) per param, plus 3 HF copies"
    else:
        kept = max(2 * ckpt(cfg.cpt), 2 * ckpt(cfg.sft))
        how = f"{n / 1e6:.1f}M params: 2 staged checkpoints of the larger stage plus 3 HF copies"
    return kept + hf, how


def check_staging_space(ctx: _Ctx) -> None:
    """Enough local disk for the estimated checkpoints (run root if local, else the staging dir)."""
    if ctx.model is None:
        return
    from tasks.core.storage import local_path_of

    uri = ctx.cfg.run_uri
    try:
        local = is_local(uri)
    except (ValueError, ImportError):
        return  # reported by check_run_root
    if local:
        where = local_path_of(uri)
    else:
        import tempfile

        where = Path(ctx.cfg.staging_dir) if ctx.cfg.staging_dir else Path(tempfile.gettempdir())
    est = estimate_local_bytes(ctx.cfg, ctx.model.config, local)
    if est is None:
        ctx.warn("staging space not checked: config.json lacks the dimensions to estimate the parameter count")
        return
    need, how = est
    free = ctx.machine.free_bytes
    if free is None:
        probe = where
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        try:
            free = shutil.disk_usage(probe).free
        except OSError:
            ctx.warn(f"staging space not checked: cannot stat {probe}")
            return
    field_ = "run_root" if local else "staging_dir"
    if free < need:
        ctx.problem(field_, f"{where}: {_human(free)} free, the run needs about {_human(need)} ({how}); free space, lower keep_last, or point {field_} at a larger disk")
    else:
        ctx.ok(f"local space at {where}: {_human(free)} free >= about {_human(need)} needed ({how})")


def check_hub(ctx: _Ctx) -> None:
    """A well-formed target repo id and a token when a push is configured."""
    hub = ctx.cfg.hub
    if hub is None:
        ctx.ok("hub: not configured, the export is not pushed")
        return
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    repo_ok = True
    try:
        validate_repo_id(hub.repo_id)
        if hub.repo_id.count("/") != 1:
            raise HFValidationError("needs exactly one '/': org/name")
    except HFValidationError as exc:
        repo_ok = False
        ctx.problem("hub.repo_id", f"{hub.repo_id!r} is not a valid Hub repo id ({str(exc).splitlines()[0]}); use 'org/name' with letters, digits, '-', '_', '.'")
    if ctx.token_present is False:
        ctx.problem("hub", "a push is configured but no Hub token was found: export HF_TOKEN on the worker or create the Prefect Secret block 'hf-token' (never put the token in the config)")
    elif ctx.token_present is None:
        ctx.warn("hub token presence not checked")
    if repo_ok and ctx.token_present:
        ctx.ok(f"hub: repo id {hub.repo_id} well formed, token available (not shown)")


def check_base_model(ctx: _Ctx) -> None:
    """Weights are safetensors (pickle only with allow_pickle); remote code only when allowed."""
    if ctx.model is None:
        return
    b, files = ctx.cfg.base_model, ctx.model.files
    safetensors = [n for n in files if n.endswith(".safetensors")]
    pickles = [n for n in files if n.endswith(PICKLE_SUFFIXES)]
    if not safetensors and pickles and not b.allow_pickle:
        ctx.problem("base_model.allow_pickle", f"{ctx.model.where} has only pickle weights ({', '.join(pickles[:3])}); pickle files can run code when loaded. Convert them to safetensors, or set base_model.allow_pickle: true if you trust the source")
    elif not safetensors and not pickles:
        ctx.problem("base_model.uri", f"{ctx.model.where} has no weight files (*.safetensors)")
    elif not safetensors:
        ctx.warn(f"base_model.allow_pickle: loading pickle weights {pickles[:3]} from {ctx.model.where} (allowed by the config)")
    else:
        ctx.ok(f"base model {ctx.model.where}: {len(safetensors)} safetensors file(s)" + (f"; {len(pickles)} pickle file(s) ignored" if pickles and not b.allow_pickle else ""))
    auto_map = ctx.model.config.get("auto_map")
    if auto_map and not b.trust_remote_code:
        ctx.problem("base_model.trust_remote_code", f"{ctx.model.where} needs its own Python code (config.json auto_map: {sorted(auto_map)}); review the repo and set base_model.trust_remote_code: true, or use a model transformers supports natively")
    elif b.trust_remote_code:
        ctx.warn("base_model.trust_remote_code is true: the model repo's Python code will run in every stage")
    else:
        ctx.ok("base model: no remote code (trust_remote_code false)")


def check_sequence_length(ctx: _Ctx) -> None:
    if ctx.model is None:
        return
    max_pos = ctx.model.config.get("max_position_embeddings")
    if not isinstance(max_pos, int):
        ctx.warn("seq_len not checked: config.json has no max_position_embeddings")
        return
    ok = True
    for name in ("cpt", "sft"):
        seq = getattr(ctx.cfg, name).seq_len
        if seq > max_pos:
            ok = False
            ctx.problem(f"{name}.seq_len", f"seq_len={seq} exceeds the base model's max_position_embeddings={max_pos}; use seq_len <= {max_pos}")
    if ok:
        ctx.ok(f"seq_len cpt={ctx.cfg.cpt.seq_len}, sft={ctx.cfg.sft.seq_len} <= max_position_embeddings={max_pos}")


def check_chat_template(ctx: _Ctx) -> None:
    if ctx.model is None:
        return
    tc = ctx.model.tokenizer_config
    if tc is None and not ctx.model.chat_template_file:
        ctx.problem("base_model.uri", f"{ctx.model.where} has no tokenizer_config.json: every stage needs the tokenizer saved beside the model")
    elif not ((tc or {}).get("chat_template") or ctx.model.chat_template_file):
        ctx.problem("base_model.uri", f"the tokenizer of {ctx.model.where} has no chat_template: SFT renders conversations with it; add chat_template to tokenizer_config.json (or a chat_template.jinja file)")
    else:
        ctx.ok("tokenizer: chat template present")


def head_records(uri: str, n: int = HEAD_RECORDS) -> list[tuple[int, dict]]:
    """(line number, record) of the first n records, without reading the whole file."""
    import fsspec

    from tasks.core.data import format_of, iter_text_records  # one definition of the formats

    fmt = format_of(uri)
    if fmt == ".parquet":
        import pyarrow.parquet as pq

        with fsspec.open(uri, "rb") as f:
            batch = next(pq.ParquetFile(f).iter_batches(batch_size=n), None)
            return list(enumerate(batch.to_pylist() if batch is not None else [], 1))
    return list(itertools.islice(iter_text_records(uri, fmt), n))


def check_data(ctx: _Ctx) -> None:
    """Each dataset exists and its first records have the fields and roles the stage needs."""
    from tasks.core.data import validate_messages  # the SFT record rules, defined once

    datasets = []
    for name in ("cpt", "sft"):
        st = getattr(ctx.cfg, name)
        datasets.append((name, f"{name}.data.uri", st.data.uri))
        if st.eval.heldout_uri:
            datasets.append((name, f"{name}.eval.heldout_uri", st.eval.heldout_uri))
    for name, where, raw_uri in datasets:
        d = getattr(ctx.cfg, name).data
        uri = resolve_local(raw_uri)
        try:
            fs, path = url_to_fs(uri)
            exists = fs.isfile(path)
        except Exception as exc:
            ctx.problem(where, f"{uri}: not reachable ({type(exc).__name__}: {exc})")
            continue
        if not exists:
            ctx.problem(where, f"{uri} does not exist; point {where} at a .jsonl, .txt or .parquet file")
            continue
        try:
            records = head_records(uri)
        except (ValueError, UnicodeDecodeError, OSError) as exc:
            ctx.problem(where, str(exc))
            continue
        if not records:
            ctx.problem(where, f"{uri} holds no records")
            continue
        failed = False
        for lineno, rec in records:
            at = f"{uri}:{lineno}"
            if name == "cpt":
                if not isinstance(rec.get(d.text_field), str):
                    ctx.problem("cpt.data.text_field", f"{at}: no string field {d.text_field!r} (fields: {sorted(rec)}); set cpt.data.text_field to the field holding the text")
                    failed = True
            elif d.messages_field not in rec:
                ctx.problem("sft.data.messages_field", f"{at}: no field {d.messages_field!r} (fields: {sorted(rec)}); set sft.data.messages_field to the field holding the chat")
                failed = True
            else:
                try:
                    validate_messages(rec[d.messages_field])
                except ValueError as exc:
                    ctx.problem(where, f"{at}: {exc}")
                    failed = True
            if failed:
                break  # one example per dataset is enough to say what is wrong
        if not failed:
            what = f"field {d.text_field!r} is text" if name == "cpt" else f"{d.messages_field!r} have valid roles and an assistant turn"
            ctx.ok(f"{name} data {uri}: first {len(records)} record(s) parse, {what}")


def check_model_family(ctx: _Ctx) -> None:
    """The base model's model_type is in the family registry: the unshard after CPT and the export
    convert checkpoints by its tensor table, so an unknown family would fail only after CPT."""
    if ctx.model is None:
        return
    from tasks.core.families import FAMILIES, supported

    model_type = ctx.model.config.get("model_type")
    if isinstance(model_type, str) and model_type in FAMILIES:
        ctx.ok(f"model family {model_type}: in the registry, so the unshard and the export can convert it")
        return
    ctx.problem(
        "base_model.uri",
        f"{ctx.model.where}: config.json model_type={model_type!r} is not a supported model family (supported: {supported()}); "
        "the unshard after CPT and the export convert checkpoints by the family's tensor table. Use a base model of a "
        "supported family, or add the family's entry to FAMILIES in tasks/core/families.py",
    )


CHECKS: tuple[Callable[[_Ctx], None], ...] = (
    check_static_rules,
    check_layout,
    check_machine,
    check_base_model,
    check_sequence_length,
    check_chat_template,
    check_data,
    check_run_root,
    check_staging_space,
    check_hub,
    check_model_family,
)


def preflight_report(
    cfg: RunConfig,
    *,
    machine: Machine | None = None,
    token_present: bool | None = None,
    model: ModelInfo | None = None,
) -> PreflightReport:
    """Run every check; never raises for a problem, returns them all in the report.

    `token_present`: whether HF_TOKEN or the Secret `hf-token` exists (the caller looks; None
    means "not checked"). `model`: the base model's metadata (read here when None).
    """
    started = time.monotonic()
    report = PreflightReport()
    if model is None:
        try:
            model = read_model_info(cfg.base_model.uri, cfg.base_model.revision)
        except ConfigError as exc:
            report.problems += exc.problems
    ctx = _Ctx(cfg, machine or Machine.detect(), token_present, model, report)
    for check in CHECKS:
        try:
            check(ctx)
        except ConfigError as exc:
            for p in exc.problems:
                ctx.problem(*p)
    report.seconds = time.monotonic() - started
    return report


def validate(cfg: RunConfig, **kwargs: Any) -> PreflightReport:
    """`preflight_report`, raising one ConfigError with every problem; the report when clean."""
    return preflight_report(cfg, **kwargs).raise_for_problems()
