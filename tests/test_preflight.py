"""Unit tier: pre-flight refuses bad configurations and inputs before anything is launched.

    .venv/bin/python -m pytest tests/test_preflight.py -q

Table-driven: each case mutates a good config (and its inputs), runs `tasks.core.preflight.checks`, and
expects a problem naming the config field or file. No weights are read: the base model is a
config.json, a tokenizer_config.json and an empty model.safetensors. Every test runs with
subprocess.Popen and tasks.core.launch.torchrun.run_engine replaced by functions that fail the test.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tasks.core.errors import ConfigError
from tasks.core.preflight.checks import Machine, load_for_check, preflight_report, validate
from tasks.core.run.manifest import MANIFEST
from tests.conftest import tiny_config_raw, write_config

CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
TINY_DIMS = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=256,
)
LLAMA3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
)
CPU2 = Machine(cuda_devices=0, cpu_count=2, free_bytes=10**13)


@pytest.fixture(autouse=True)
def no_launch(monkeypatch, tmp_path):
    """Pre-flight must never start a process: any launch attempt fails the test."""

    def refuse(*args: Any, **kwargs: Any):
        raise AssertionError(f"pre-flight started a process: {args[:1]}")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    import tasks.core.launch.torchrun

    monkeypatch.setattr(tasks.core.launch.torchrun, "run_engine", refuse, raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    # No saved `hf auth login` token either: the lookup's third source reads HF_TOKEN_PATH.
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-hf-home" / "token"))


def fake_model(
    root: Path, tokenizer: dict | None = None, weights: tuple[str, ...] = ("model.safetensors",), **dims: Any
) -> Path:
    """An HF model directory as far as pre-flight can tell, without any weights."""
    root.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "torch_dtype": "float32",
        **TINY_DIMS,
        **dims,
    }
    (root / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    tok = {"eos_token": "<|end_of_text|>", "chat_template": CHAT_TEMPLATE} if tokenizer is None else tokenizer
    (root / "tokenizer_config.json").write_text(json.dumps(tok))
    for name in weights:  # a safetensors file with no tensors (its header is checked), or an empty pickle
        (root / name).write_bytes((2).to_bytes(8, "little") + b"{}" if name.endswith(".safetensors") else b"")
    return root


def write_jsonl(path: Path, lines: list[Any]) -> str:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


def make_manifest(run_root: Path, rel: str, files: dict[str, Any]) -> Path:
    art = run_root / rel
    art.mkdir(parents=True, exist_ok=True)
    (art / MANIFEST).parent.mkdir(parents=True, exist_ok=True)
    (art / MANIFEST).write_text(json.dumps({"schema": 1, "kind": "hf-model", "files": files}))
    return art


class Case:
    """A good tiny config plus one mutation of the config (`raw`) or of the inputs (`env`)."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.model = fake_model(tmp / "model")
        self.run_root = tmp / "run"
        self.raw = tiny_config_raw(self.model, self.run_root)
        self.machine = CPU2
        self.token: bool | None = None

    def report(self):
        cfg = load_for_check(write_config(self.tmp / "config.yaml", self.raw))
        return preflight_report(cfg, machine=self.machine, token_present=self.token)


def _set(path: str, value: Any) -> Callable[[Case], None]:
    def apply(c: Case) -> None:
        node = c.raw
        *parents, leaf = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value

    return apply


def _all(*fs: Callable[[Case], None]) -> Callable[[Case], None]:
    def apply(c: Case) -> None:
        for f in fs:
            f(c)

    return apply


def _llama3(c: Case) -> None:
    fake_model(c.model, **LLAMA3_8B)


def _data(phase: str, lines: list[Any], name: str = "data.jsonl") -> Callable[[Case], None]:
    def apply(c: Case) -> None:
        c.raw[phase]["data"]["uri"] = write_jsonl(c.tmp / f"{phase}-{name}", lines)

    return apply


def _under_a_file(c: Case) -> None:
    (c.tmp / "a-file").write_text("not a directory")
    c.raw["run_root"] = str(c.tmp / "a-file" / "run")


def _pickle_only(c: Case) -> None:
    (c.model / "model.safetensors").unlink()
    (c.model / "pytorch_model.bin").write_bytes(b"\x80\x04")


def _manifest(files: dict[str, Any]) -> Callable[[Case], None]:
    return lambda c: make_manifest(c.run_root, "base", files)


def _symlink_out(c: Case) -> None:
    art = make_manifest(c.run_root, "cpt/hf", {"model.safetensors": {"size": 4, "sha256": "0" * 64}})
    (c.tmp / "outside.safetensors").write_bytes(b"1234")
    os.symlink(c.tmp / "outside.safetensors", art / "model.safetensors")


def _machine(**kw: Any) -> Callable[[Case], None]:
    def apply(c: Case) -> None:
        c.machine = Machine(**{"cuda_devices": 0, "cpu_count": 2, "free_bytes": 10**13, **kw})

    return apply


def _token(present: bool) -> Callable[[Case], None]:
    def apply(c: Case) -> None:
        c.token = present

    return apply


USER, ASSISTANT = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}
HP = {"name": "hybrid_parallel", "zero_stage": 0, "precision": "fp32"}

# (id, mutation, expected field, words in the message)
BAD = [
    (
        "tp3-on-8-kv-heads",
        _all(_llama3, _set("cpt.plugin", {**HP, "tp_size": 3}), _set("cpt.launch", {"nproc_per_node": 3})),
        "cpt.plugin.tp_size",
        "Valid tp_size: [1, 2, 4, 8]",
    ),
    (
        "tp-not-dividing-tiny-kv",
        _all(_set("cpt.plugin", {**HP, "tp_size": 4}), _set("cpt.launch", {"nproc_per_node": 4})),
        "cpt.plugin.tp_size",
        "num_key_value_heads=2",
    ),
    (
        "pp-more-than-layers",
        _all(
            _set("cpt.plugin", {**HP, "tp_size": 1, "pp_size": 8}),
            _set("cpt.launch", {"nproc_per_node": 8}),
            _set("cpt.grad_accum_steps", 8),
        ),
        "cpt.plugin.pp_size",
        "num_hidden_layers=4",
    ),
    ("world-size-mismatch", _set("cpt.launch", {"nproc_per_node": 3}), "cpt.launch", "multiple of tp_size*pp_size"),
    (
        "zero-with-fp32",
        _set("sft.plugin", {**HP, "zero_stage": 1, "precision": "fp32"}),
        "sft.plugin.precision",
        "fp32 with ZeRO is refused under hybrid_parallel",
    ),
    ("gemini-on-cpu", _set("sft.plugin", {"name": "gemini", "precision": "bf16"}), "sft.plugin.name", "needs CUDA"),
    (
        "packing-under-hybrid-parallel",
        _all(_set("sft.plugin", HP), _set("sft.batching", "packed")),
        "sft.batching",
        (
            "packed conversations would attend to each other; set sft.plugin.name: low_level_zero and "
            "sft.plugin.zero_stage: 1"
        ),
    ),
    (
        "lora-under-gemini",
        _all(_set("sft.plugin", {"name": "gemini", "precision": "bf16"}), _set("sft.lora", {"r": 8})),
        "sft.lora",
        (
            "enable_lora raises NotImplementedError in colossalai 0.5.0 (ColossalAI #6138); set sft.plugin.name: "
            "hybrid_parallel; or set sft.plugin.name: low_level_zero"
        ),
    ),
    (
        "lora-under-tp2",
        _all(
            _set("sft.plugin", {**HP, "tp_size": 2}),
            _set("sft.launch", {"nproc_per_node": 2}),
            _set("sft.lora", {"r": 8}),
        ),
        "sft.plugin.tp_size",
        "LoRA under hybrid_parallel needs tp_size 1 (HybridParallelPlugin.enable_lora asserts tp_size == 1",
    ),
    (
        "lora-under-pp2",
        _all(
            _set("sft.plugin", {**HP, "pp_size": 2}),
            _set("sft.launch", {"nproc_per_node": 2}),
            _set("sft.grad_accum_steps", 2),
            _set("sft.lora", {"r": 8}),
        ),
        "sft.plugin.pp_size",
        "LoRA under hybrid_parallel needs pp_size 1",
    ),
    (
        "qlora-on-cpu",
        _set("sft.lora", {"r": 8, "quantize": True}),
        "sft.lora.quantize",
        "bitsandbytes, whose kernels run on CUDA only, and no GPU is visible here",
    ),
    ("lora-on-cpt", _set("cpt.lora", {"r": 8}), "cpt.lora", "LoRA is for SFT only"),
    (
        "ddp-fp16-on-cpu",
        _set("sft.plugin", {"name": "torch_ddp", "precision": "fp16"}),
        "sft.plugin.precision",
        "needs CUDA",
    ),
    (
        "pipeline-microbatches-not-dividing",
        _all(
            _set("cpt.plugin", {**HP, "tp_size": 1, "pp_size": 2, "num_microbatches": 4}),
            _set("cpt.micro_batch_size", 3),
            _set("cpt.grad_accum_steps", 2),
        ),
        "cpt.plugin.num_microbatches",
        "does not divide",
    ),
    (
        "pipeline-too-few-microbatches",
        _set("cpt.plugin", {**HP, "tp_size": 1, "pp_size": 2}),
        "cpt.plugin.num_microbatches",
        "at least pp_size=2",
    ),
    ("more-ranks-than-gpus", _machine(cuda_devices=1), "cpt.launch.nproc_per_node", "1 GPU(s) are visible"),
    (
        "missing-data-file",
        _set("cpt.data.uri", "/nonexistent/cpt.jsonl"),
        "cpt.data.uri",
        "/nonexistent/cpt.jsonl does not exist",
    ),
    ("unknown-data-format", _data("cpt", ["a,b"], name="data.csv"), "cpt.data.uri", "unknown format"),
    (
        "malformed-jsonl",
        _data("sft", [{"messages": [USER, ASSISTANT]}, "{not json"]),
        "sft.data.uri",
        "sft-data.jsonl:2: malformed JSON",
    ),
    ("sft-without-assistant", _data("sft", [{"messages": [USER]}]), "sft.data.uri", "no assistant message"),
    (
        "sft-bad-role",
        _data("sft", [{"messages": [{"role": "wizard", "content": "x"}, ASSISTANT]}]),
        "sft.data.uri",
        "role 'wizard'",
    ),
    (
        "sft-missing-messages-field",
        _data("sft", [{"conversation": [USER, ASSISTANT]}]),
        "sft.data.messages_field",
        "no field 'messages'",
    ),
    (
        "cpt-missing-text-field",
        _data("cpt", [{"body": "text"}]),
        "cpt.data.text_field",
        "no field 'text' (fields: ['body']); set cpt.data.text_field",
    ),
    ("empty-dataset", _data("cpt", []), "cpt.data.uri", "holds no records"),
    (
        "glob-matching-nothing",
        _set("cpt.data.uri", "/nonexistent/corpus/part-*.jsonl"),
        "cpt.data.uri",
        "matches no file",
    ),
    (
        "directory-without-corpus-files",
        lambda c: ((c.tmp / "empty-corpus").mkdir(), _set("sft.data.uri", str(c.tmp / "empty-corpus"))(c)),
        "sft.data.uri",
        "holds no .jsonl, .parquet file",
    ),
    ("unreachable-run-root", _set("run_root", "nosuchproto://bucket/run"), "run_root", "not reachable"),
    ("unwritable-run-root-below-a-file", _under_a_file, "run_root", "not writable"),
    ("staging-space-too-small", _machine(free_bytes=1000), "run_root", "1.0 KB free, the run needs about"),
    ("push-without-token", _all(_set("hub", {"repo_id": "my-org/tiny"}), _token(False)), "hub", "no Hub token"),
    (
        "malformed-repo-id",
        _all(_set("hub", {"repo_id": "not a repo"}), _token(True)),
        "hub.repo_id",
        "not a valid Hub repo id",
    ),
    (
        "push-adapter-without-lora",
        _all(_set("hub", {"repo_id": "my-org/tiny", "push_adapter": True}), _token(True)),
        "hub.push_adapter",
        "there is no adapter to push: SFT trains the whole model (sft.lora is not set)",
    ),
    (
        "adapter-repo-is-the-model-repo",
        _all(
            _set("sft.lora", {"r": 8}),
            _set("hub", {"repo_id": "my-org/tiny", "push_adapter": True, "adapter_repo_id": "my-org/tiny"}),
            _token(True),
        ),
        "hub.adapter_repo_id",
        "the adapter would sit beside the merged weights",
    ),
    (
        "malformed-adapter-repo-id",
        _all(
            _set("sft.lora", {"r": 8}),
            _set("hub", {"repo_id": "my-org/tiny", "push_adapter": True, "adapter_repo_id": "no/such/repo"}),
            _token(True),
        ),
        "hub.adapter_repo_id",
        "not a valid Hub repo id",
    ),
    ("repo-id-without-org", _all(_set("hub", {"repo_id": "a/b/c"}), _token(True)), "hub.repo_id", "org/name"),
    (
        "look-alike-repo-id",  # a Cyrillic o (U+043E): huggingface_hub's own validator takes it
        _all(_set("hub", {"repo_id": "\u043erg/name"}), _token(True)),
        "hub.repo_id",
        "(U+043E CYRILLIC SMALL LETTER O) at position 0; a Hub repo id takes ASCII characters only",
    ),
    (
        "license-with-a-newline",
        _all(_set("hub", {"repo_id": "my-org/tiny", "license": "mit\nextra: injected"}), _token(True)),
        "hub.license",
        "is not one of the Hub's license identifiers",
    ),
    (
        "tag-with-markup",
        _all(_set("hub", {"repo_id": "my-org/tiny", "tags": ["ok", "<img src=x onerror=alert(1)>"]}), _token(True)),
        "hub.tags",
        "tag 1 '<img src=x onerror=alert(1)>': a tag is 1 to 64 ASCII letters",
    ),
    ("pickle-only-base-model", _pickle_only, "base_model.allow_pickle", "pytorch_model.bin"),
    ("no-weights", lambda c: (c.model / "model.safetensors").unlink(), "base_model.uri", "no weight files"),
    (
        "remote-code-without-trust",
        lambda c: fake_model(c.model, auto_map={"AutoModelForCausalLM": "modeling_x.X"}),
        "base_model.trust_remote_code",
        "its own Python code",
    ),
    ("missing-base-model", _set("base_model.uri", "/nonexistent/model"), "base_model.uri", "does not exist"),
    (
        "manifest-with-dotdot",
        _manifest({"../../etc/passwd": {"size": 1, "sha256": "0" * 64}}),
        "/run/base/.cpt-to-sft/manifest.json",
        "escapes the artifact",
    ),
    (
        "manifest-with-absolute-path",
        _manifest({"/etc/passwd": {"size": 1, "sha256": "0" * 64}}),
        "/run/base/.cpt-to-sft/manifest.json",
        "is absolute",
    ),
    (
        "manifest-with-symlink-out",
        _symlink_out,
        "/run/cpt/hf/.cpt-to-sft/manifest.json",
        "resolves outside the artifact",
    ),
    ("seq-len-over-max-positions", _set("sft.seq_len", 1024), "sft.seq_len", "max_position_embeddings=256"),
    (
        "seq-len-over-the-extended-positions",
        _all(_set("cpt.context", {"max_position_embeddings": 512}), _set("cpt.seq_len", 1024)),
        "cpt.seq_len",
        "exceeds cpt.context.max_position_embeddings=512",
    ),
    (
        "rope-type-transformers-does-not-build",
        _set("cpt.context", {"rope_scaling": {"rope_type": "ntk", "factor": 2.0}}),
        "cpt.context.rope_scaling",
        "use one of default, linear, dynamic, yarn, longrope, llama3",
    ),
    (
        "llama3-scaling-from-the-length-it-extends-to",
        _set(
            "cpt.context",
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 2.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 256,
                }
            },
        ),
        "cpt.context.rope_scaling",
        "original_max_position_embeddings=256 must be below max_position_embeddings=256",
    ),
    (
        "document-attention-under-shardformer",
        _set("cpt.attention", "document"),
        "cpt.attention",
        "attention document is refused under plugin hybrid_parallel",
    ),
    (
        "tokenizer-without-chat-template",
        lambda c: fake_model(c.model, tokenizer={"eos_token": "</s>"}),
        "base_model.uri",
        "no chat_template",
    ),
    (
        "unknown-model-family",
        lambda c: fake_model(c.model, model_type="tinyfam"),
        "base_model.uri",
        "model_type='tinyfam' is neither in the family registry nor a model type the installed transformers knows",
    ),
    (
        "gpu-memory-too-small",
        _all(
            _llama3,
            _set("cpt.plugin", {"name": "low_level_zero", "zero_stage": 1, "precision": "bf16"}),
            _set("cpt.launch", {"nproc_per_node": 8, "gpu_memory_gb": 40}),
        ),
        "cpt.launch.gpu_memory_gb",
        "more than the 40.00 GB of cpt.launch.gpu_memory_gb = 40; it fits with cpt.plugin.zero_stage: 2",
    ),
]


@pytest.mark.parametrize("mutate, field, words", [pytest.param(m, f, w, id=i) for i, m, f, w in BAD])
def test_bad_input_fails_preflight_naming_the_field(tmp_path, mutate, field, words):
    case = Case(tmp_path)
    mutate(case)
    report = case.report()
    assert not report.ok
    matches = [msg for f, msg in report.problems if f == field or f.endswith(field)]
    assert matches, f"expected a problem on {field!r}, got:\n{report.text()}"
    assert any(words in msg for msg in matches), report.text()
    with pytest.raises(ConfigError) as info:
        report.raise_for_problems()
    assert field.split("/")[-1] in str(info.value)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_llama3_8b_layout_accepts_tp_dividing_its_8_kv_heads(tmp_path, tp):
    case = Case(tmp_path)
    _all(
        _llama3,
        _set("cpt.plugin", {**HP, "tp_size": tp}),
        _set("cpt.launch", {"nproc_per_node": tp}),
        _machine(cuda_devices=8),
    )(case)
    report = case.report()
    assert report.ok, report.text()
    assert any(f"tp={tp}, divides 32 heads / 8 KV heads" in c for c in report.checked)


def test_every_problem_is_reported_at_once(tmp_path):
    case = Case(tmp_path)
    _all(
        _llama3,
        _set("cpt.plugin", {**HP, "tp_size": 3}),
        _set("cpt.launch", {"nproc_per_node": 3}),
        _set("sft.plugin", {**HP, "zero_stage": 1}),
        _set("sft.data.uri", str(tmp_path / "missing.jsonl")),
        _set("hub", {"repo_id": "bad id"}),
        _token(False),
    )(case)
    with pytest.raises(ConfigError) as info:
        validate(load_for_check(write_config(tmp_path / "c.yaml", case.raw)), machine=case.machine, token_present=False)
    fields = {f for f, _ in info.value.problems}
    assert {"cpt.plugin.tp_size", "sft.plugin.precision", "sft.data.uri", "hub.repo_id", "hub"} <= fields, str(
        info.value
    )


def test_vocab_not_divisible_by_tp_is_refused_with_valid_choices(tmp_path):
    # ColossalAI would pad the vocabulary for TP and then fail to save the padded optimizer state.
    case = Case(tmp_path)
    fake_model(case.model, vocab_size=515)
    report = case.report()
    assert not report.ok
    msgs = [m for f, m in report.problems if f == "cpt.plugin.tp_size"]
    assert msgs and "vocab_size=515" in msgs[0] and "[1]" in msgs[0], report.text()


def test_oversubscribed_cpu_is_a_warning_not_an_error(tmp_path):
    case = Case(tmp_path)
    _machine(cpu_count=1)(case)
    report = case.report()
    assert report.ok, report.text()
    assert any("oversubscribes" in w for w in report.warnings)


def test_the_token_never_appears_in_the_report(tmp_path, monkeypatch):
    import huggingface_hub.constants

    from tasks.flowkit.preflight import check

    secret = "hf_SECRETsecretSECRET123"
    monkeypatch.setenv("HF_TOKEN", secret)
    # Pre-flight asks the Hub whoami: an endpoint nobody listens on keeps this test offline (a warning, not a problem).
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    case = Case(tmp_path)
    case.raw["hub"] = {"repo_id": "my-org/tiny"}
    report = check(write_config(tmp_path / "c.yaml", case.raw))
    assert report.ok, report.text()
    assert secret not in report.text() and "token available" in report.text()


def test_good_config_passes_and_lists_what_was_checked(tmp_path, tiny_model_dir, capsys):
    from tasks.flowkit.preflight import run_check_cli

    path = write_config(tmp_path / "good.yaml", tiny_config_raw(tiny_model_dir, tmp_path / "run"))
    assert run_check_cli(str(path)) == 0
    out = capsys.readouterr().out
    assert "pre-flight passed" in out
    for words in (
        "cpt layout: hybrid_parallel tp=2",
        "sft layout: low_level_zero",
        "safetensors",
        "chat template",
        "cpt data",
        "sft data",
        "probe object written",
        "free >=",
        "max_position_embeddings",
        "hub: not configured",
    ):
        assert words in out, f"{words!r} missing from:\n{out}"
    assert not list((tmp_path / "run").glob(".preflight-probe-*")), "the probe object must be deleted"


def test_cli_check_fails_with_the_report_and_launches_nothing(tmp_path, capsys):
    from tasks.flowkit.preflight import run_check_cli

    case = Case(tmp_path)
    _all(_set("sft.plugin", {**HP, "zero_stage": 1}), _set("cpt.data.uri", "/nonexistent/x.jsonl"))(case)
    assert run_check_cli(str(write_config(tmp_path / "bad.yaml", case.raw))) == 1
    out = capsys.readouterr().out
    assert "pre-flight failed, nothing was launched (2 problems)" in out
    assert "sft.plugin.precision" in out and "cpt.data.uri" in out


def test_cli_check_reports_structural_errors(tmp_path, capsys):
    from tasks.flowkit.preflight import run_check_cli

    case = Case(tmp_path)
    case.raw["cpt"]["typo_field"] = 1
    assert run_check_cli(str(write_config(tmp_path / "bad.yaml", case.raw))) == 1
    assert "cpt.typo_field" in capsys.readouterr().out


def test_cli_check_without_token_or_server_says_the_secret_was_not_consulted(tmp_path, capsys):
    from tasks.flowkit.preflight import run_check_cli

    case = Case(tmp_path)
    case.raw["hub"] = {"repo_id": "my-org/tiny"}
    assert run_check_cli(str(write_config(tmp_path / "c.yaml", case.raw))) == 1
    out = capsys.readouterr().out
    assert "no Hub token" in out and "not consulted" in out


def test_preflight_task_fails_with_the_report_and_one_config_error(tmp_path, monkeypatch):
    import logging

    import tasks.flowkit.preflight as mod

    monkeypatch.setattr(mod, "get_run_logger", lambda: logging.getLogger("preflight-test"))
    monkeypatch.setattr(mod, "_secret_value", lambda timeout=0: None)
    case = Case(tmp_path)
    _all(_set("hub", {"repo_id": "my-org/tiny"}), _set("sft.seq_len", 1024))(case)
    cfg = load_for_check(write_config(tmp_path / "c.yaml", case.raw))
    state = mod.preflight.fn(cfg)  # a Failed state with the report, not a raise: no traceback
    assert state.is_failed() and "sft.seq_len" in state.message and "hub" in state.message
    with pytest.raises(ConfigError) as info:
        state.result()
    assert {"hub", "sft.seq_len"} <= {f for f, _ in info.value.problems}


def test_preflight_task_returns_the_checked_list(tmp_path, monkeypatch):
    import logging

    import tasks.flowkit.preflight as mod

    monkeypatch.setattr(mod, "get_run_logger", lambda: logging.getLogger("preflight-test"))
    cfg = load_for_check(write_config(tmp_path / "c.yaml", Case(tmp_path).raw))
    out = mod.preflight.fn(cfg)
    assert out["checked"] and any("run root" in c for c in out["checked"])


def test_hub_base_model_is_read_from_config_json_and_the_file_list_only(tmp_path, monkeypatch):
    import huggingface_hub

    fetched: list[str] = []

    def fake_download(repo_id: str, filename: str, revision: str = "main", **_: Any) -> str:
        fetched.append(filename)
        model = fake_model(tmp_path / "hub-cache")
        return str(model / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    monkeypatch.setattr(
        huggingface_hub.HfApi,
        "list_repo_files",
        lambda self, repo, revision=None: [
            "config.json",
            "tokenizer_config.json",
            "pytorch_model.bin",
            "sub/x.safetensors",
        ],
    )
    case = Case(tmp_path)
    case.raw["base_model"]["uri"] = "some-org/some-model"
    report = case.report()
    assert fetched == ["config.json", "tokenizer_config.json"]
    assert [f for f, _ in report.problems] == ["base_model.allow_pickle"], report.text()
    assert "some-org/some-model@main" in report.problems[0][1]


def test_missing_heldout_uri_names_the_eval_field(tmp_path):
    case = Case(tmp_path)
    case.raw["sft"]["eval"] = {"heldout_uri": str(tmp_path / "nope.jsonl")}
    report = case.report()
    assert any(f == "sft.eval.heldout_uri" and "does not exist" in m for f, m in report.problems), report.text()


def test_a_missing_path_names_its_look_alike_by_unicode_form_or_case(tmp_path):
    """A data file stored NFD (macOS, archives) while the config names it NFC, and a model folder in
    another case: "does not exist" once named nothing more. Pre-flight names the look-alike."""
    import unicodedata

    case = Case(tmp_path)
    data = Path(case.raw["sft"]["data"]["uri"])
    stored = tmp_path / unicodedata.normalize("NFD", "café-chats.jsonl")
    stored.write_bytes(data.read_bytes())
    case.raw["sft"]["data"]["uri"] = str(tmp_path / unicodedata.normalize("NFC", "café-chats.jsonl"))
    case.model.rename(tmp_path / "Model")
    case.raw["base_model"]["uri"] = str(tmp_path / "model")
    said = dict(case.report().problems)
    assert "does not exist" in said["sft.data.uri"] and "a look-alike exists" in said["sft.data.uri"], said
    assert (
        "stored as 'cafe\\u0301-chats.jsonl', in Unicode NFD; the config says 'caf\\xe9-chats.jsonl'"
        in said["sft.data.uri"]
    )
    assert f"{str(tmp_path / 'Model')!r} (stored as 'Model', in another case" in said["base_model.uri"], said
    assert "name it exactly as stored, or rename it" in said["base_model.uri"]
    with pytest.raises(ConfigError, match="stored as 'config.yaml', in another case"):  # the config file itself
        load_for_check(tmp_path / "Config.yaml")


def test_multi_node_without_rendezvous_endpoint_is_refused():
    import yaml

    from tasks.core.config.load import parse_config
    from tests.conftest import REPO

    raw = yaml.safe_load((REPO / "examples/tiny-cpu.yaml").read_text())
    raw["cpt"]["launch"] = {"nproc_per_node": 1, "nnodes": 2}
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    assert "cpt.launch.rdzv_endpoint" in {f for f, _ in info.value.problems}


# ---- the model-family registry (tasks/core/models/families.py) -----------------------------------------


def _llama_shaped_estimate(mc: dict[str, Any]) -> int:
    """A reference count from the Llama shape alone (attention, gated MLP, norms, embeddings), independent of the family registry."""
    h, i, n_layers, vocab = (
        int(mc[k]) for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")
    )
    n_heads = int(mc["num_attention_heads"])
    n_kv = int(mc.get("num_key_value_heads") or n_heads)
    head_dim = int(mc.get("head_dim") or h // n_heads)
    per_layer = h * n_heads * head_dim * 2 + h * n_kv * head_dim * 2 + 3 * h * i + 2 * h
    return n_layers * per_layer + vocab * h * (1 if mc.get("tie_word_embeddings") else 2) + h


_H, _I, _Q, _KV = (
    TINY_DIMS["hidden_size"],
    TINY_DIMS["intermediate_size"],
    TINY_DIMS["hidden_size"],
    TINY_DIMS["hidden_size"] // 2,
)


@pytest.mark.parametrize(
    "model_type, overrides, left_out_per_layer",
    [
        ("llama", {}, 0),
        ("llama", {"tie_word_embeddings": True}, 0),
        (
            "llama",
            {"attention_bias": True, "mlp_bias": True},
            _Q + 2 * _KV + _H + 2 * _I + _H,
        ),  # q/k/v/o and MLP biases
        ("mistral", {}, 0),
        ("qwen2", {"tie_word_embeddings": True}, _Q + 2 * _KV),  # q/k/v biases
        ("qwen3", {"head_dim": 16}, 2 * 16),  # q_norm and k_norm
        ("gemma3_text", {"head_dim": 16}, 2 * 16 + 2 * _H),  # q/k norms, pre/post-feedforward norms
        ("phi3", {"pad_token_id": None}, 0),  # fused qkv and gate_up: the same parameters
    ],
    ids=["llama", "llama-tied", "llama-biases", "mistral", "qwen2-tied", "qwen3", "gemma3-tied", "phi3"],
)
def test_parameter_estimate_is_the_family_table_count(model_type, overrides, left_out_per_layer):
    import transformers

    from tasks.core.models.families import FAMILIES
    from tasks.core.preflight.checks import estimate_parameters

    spec = FAMILIES[model_type]
    config = getattr(transformers, spec.config_class)(**TINY_DIMS, **overrides)
    model = getattr(transformers, spec.model_class)(config)
    mc = config.to_dict()
    assert estimate_parameters(mc) == model.num_parameters()  # the real model, a tied weight once
    # the Llama-shaped reference agrees, except for the tensors it does not know of
    assert estimate_parameters(mc) == _llama_shaped_estimate(mc) + TINY_DIMS["num_hidden_layers"] * left_out_per_layer


def test_parameter_estimate_of_llama3_8b_is_unchanged():
    from tasks.core.preflight.checks import estimate_parameters

    mc = {"model_type": "llama", **LLAMA3_8B}
    assert estimate_parameters(mc) == _llama_shaped_estimate(mc) == 8_030_261_248  # Meta-Llama-3-8B's published count
    assert estimate_parameters({"model_type": "tinyfam", **LLAMA3_8B}) is None  # refused by check_model_family instead


def test_the_staging_space_check_names_an_unknown_family_not_missing_dimensions(tmp_path):
    from types import SimpleNamespace

    from tasks.core.preflight.storage import check_staging_space

    said: list[str] = []
    unknown = {"model_type": "veyra_net", "n_embd": 64, "n_layer": 2}
    ctx = SimpleNamespace(
        model=SimpleNamespace(config=unknown), cfg=SimpleNamespace(run_uri=str(tmp_path)), warn=said.append
    )
    check_staging_space(ctx)
    assert len(said) == 1 and said[0].startswith("staging space not checked: config.json model_type='veyra_net'")
    assert "lacks the dimensions" not in said[0] and "llama" in said[0]  # names the known families
    said.clear()
    ctx.model.config = {"model_type": "llama", "hidden_size": 64}  # a known family, dimensions missing
    check_staging_space(ctx)
    assert len(said) == 1 and said[0].startswith("staging space not checked: config.json (llama) lacks integer field")
    assert "cannot derive tensor shapes" in said[0]


def test_a_new_model_family_is_one_registry_entry(tmp_path, monkeypatch):
    """Registering a family (a renamed copy of llama) is all that pre-flight and the converter need."""
    import dataclasses

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tasks.core.models.convert import convert_checkpoint, load_state_dict_from_dir
    from tasks.core.models.families import FAMILIES
    from tasks.core.preflight.checks import estimate_parameters
    from tests.test_convert import pp2_stages, write_colossal_checkpoint

    case = Case(tmp_path)
    fake_model(case.model, model_type="tinyfam")
    refused = case.report()
    assert [f for f, _ in refused.problems] == ["base_model.uri"], refused.text()
    assert "model_type='tinyfam' is neither in the family registry" in refused.problems[0][1]

    monkeypatch.setitem(FAMILIES, "tinyfam", dataclasses.replace(FAMILIES["llama"]))
    report = case.report()
    assert report.ok, report.text()
    assert "model family tinyfam: in the registry, so the unshard and the export can convert it" in report.checked

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_DIMS))
    state = {k: v.detach() for k, v in model.named_parameters()}
    mc = {**model.config.to_dict(), "model_type": "tinyfam"}
    assert estimate_parameters(mc) == model.num_parameters()
    src = write_colossal_checkpoint(state, tmp_path / "ckpt", stages=pp2_stages(state, TINY_DIMS["num_hidden_layers"]))
    converted = convert_checkpoint(src, tmp_path / "hf", model_config=mc, fsync=False)
    assert converted.keys == list(state) and converted.num_params == model.num_parameters()
    got = load_state_dict_from_dir(tmp_path / "hf")
    assert sorted(got) == sorted(state) and all(torch.equal(got[k], v) for k, v in state.items())
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "tinyfam"
