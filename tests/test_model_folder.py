"""Unit tier: the base model's folder and the run root are judged before launch.

    .venv/bin/python -m pytest -q tests/test_model_folder.py

LoRA targets resolved against the model (the same answer as peft's, for every family), broken
tokenizer/config files refused naming the file, files that are not what their name says named and
left out of every model folder, user files in an artifact's place moved aside (never deleted), and
`--check` writing nothing. No launch: pre-flight runs on `tests/test_preflight.py`'s fake model or
the demo's tiny one.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest

import flows.cpt_to_sft  # noqa: F401 - Prefect sets up its console logging on import: not under a test's capsys
from tasks.core.models import lora_targets as lt
from tasks.core.models.families import FAMILIES
from tests.conftest import tiny_config_raw, write_config
from tests.test_preflight import Case, _set


def _problems(report, field):
    return [msg for f, msg in report.problems if f == field or f.endswith(field)]


# ---- item 2: LoRA targets -----------------------------------------------------------------


@pytest.mark.parametrize(
    "targets, words",
    [
        (["q_proj", "qkv_proj"], "'qkv_proj' matches no module of"),
        (["wqkv"], "'wqkv' matches no module of"),
        (
            ["self_attn"],
            (
                "LoRA can adapt only linear and embedding modules, but the targets match model.layers.0.self_attn "
                "(container)"
            ),
        ),
        (["input_layernorm"], "model.layers.0.input_layernorm (norm)"),
        (r"model\.layers\.\d+\.attn\.q_proj", "the regex"),
        (["all-linear"], "or use 'all-linear' (without the list)"),
    ],
)
def test_a_lora_target_the_model_lacks_is_refused_naming_it_and_the_models_modules(tmp_path, targets, words):
    case = Case(tmp_path)
    _set("sft.lora", {"r": 8, "target_modules": targets})(case)
    report = case.report()
    msgs = _problems(report, "sft.lora.target_modules")
    assert any(words in m for m in msgs), report.text()
    assert any(
        "down_proj, embed_tokens, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj" in m for m in msgs
    ), msgs


@pytest.mark.parametrize(
    "targets, adapted",
    [
        (["q_proj", "v_proj"], 8),
        ("all-linear", 28),
        (r".*\.layers\.[01]\.self_attn\.(q|k)_proj", 4),
        (["mlp.down_proj", "embed_tokens"], 5),
    ],
)
def test_peft_forms_of_lora_targets_pass_and_say_what_they_adapt(tmp_path, targets, adapted):
    case = Case(tmp_path)
    _set("sft.lora", {"r": 8, "target_modules": targets})(case)
    report = case.report()
    assert not _problems(report, "sft.lora.target_modules"), report.text()
    assert any(line.startswith("LoRA targets") and f"adapt {adapted} modules" in line for line in report.checked), (
        report.checked
    )


def test_dpo_lora_targets_are_resolved_and_named_by_their_own_field(tmp_path):
    """dpo.lora adapts sft/hf, whose modules are the base's: the same check, its problems under dpo's field."""
    from support import REPO

    case = Case(tmp_path)
    _set("sft.lora", {"r": 8, "target_modules": ["q_proj", "v_proj"]})(case)
    dpo = {"data": {"uri": str(REPO / "data" / "sample" / "dpo.jsonl")}, "plugin": {"name": "torch_ddp"}}
    _set("dpo", {**dpo, "max_steps": 2, "seq_len": 128, "lr": 1e-5, "lora": {"r": 4, "target_modules": ["qkv_proj"]}})(
        case
    )
    report = case.report()
    assert not _problems(report, "sft.lora.target_modules"), report.text()
    (msg,) = _problems(report, "dpo.lora.target_modules")
    assert "'qkv_proj' matches no module of" in msg, report.text()
    assert any(line.startswith("LoRA targets q_proj, v_proj (sft.lora): adapt 8 modules") for line in report.checked)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("tied", [False, True])
def test_the_family_table_resolves_targets_as_peft_does_on_the_real_model(family, tied):
    """The module table pre-flight derives from config.json, and what peft adapts on the model
    transformers builds from that config: the same modules for every form of target_modules."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model
    from peft.tuners.tuners_utils import BaseTunerLayer

    spec = FAMILIES[family]
    mc = {
        "model_type": family,
        "vocab_size": 64,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "tie_word_embeddings": tied,
        "attention_bias": True,
        "mlp_bias": True,
        "head_dim": 8,
        **spec.demo_config,
    }
    config = getattr(transformers, spec.config_class)(**mc)
    torch.manual_seed(0)
    modules = lt.model_modules({**config.to_dict(), "model_type": family})
    for targets in (
        ["q_proj", "down_proj"],
        "all-linear",
        r".*\.1\.mlp\.(up|gate)_proj",
        ["embed_tokens", "lm_head"],
        ["q_proj", "qkv_proj"],
    ):
        model = getattr(transformers, spec.model_class)(config)
        real = {
            n: (
                "linear"
                if isinstance(m, torch.nn.Linear)
                else "embedding"
                if isinstance(m, torch.nn.Embedding)
                else "other"
            )
            for n, m in model.named_modules()
        }
        assert {n: k for n, k in real.items() if k != "other"} == {
            n: k for n, k in modules.items() if k in lt.LORA_KINDS
        }
        ours = list(lt.resolve(targets, modules, lt.output_embedding(mc)).adapted)
        if not ours:  # phi3's fused gate_up_proj: the regex matches nothing, and peft refuses it too
            with pytest.raises(ValueError, match="not found in the base model"):
                get_peft_model(model, LoraConfig(r=2, target_modules=targets))
            continue
        peft_model = get_peft_model(
            model, LoraConfig(r=2, target_modules=list(targets) if isinstance(targets, list) else targets)
        )
        by_peft = [
            n.removeprefix("base_model.model.") for n, m in peft_model.named_modules() if isinstance(m, BaseTunerLayer)
        ]
        assert list(lt.resolve(targets, modules, lt.output_embedding(mc)).adapted) == by_peft, targets


def test_the_engine_records_the_modules_peft_adapted_not_the_ones_asked(tiny_model_dir, tmp_path):
    """[q_proj, qkv_proj] (were pre-flight bypassed): peft adapts q_proj alone, and the adapter's config, the
    log line and the manifest meta say q_proj, not qkv_proj."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from tasks.core.config.lora import LoraConfig
    from tasks.engine import lora

    cfg = LoraConfig(r=2, target_modules=("q_proj", "qkv_proj"))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with pytest.raises(Exception, match="'qkv_proj' matches no module of"):
        lora.check_targets(model, cfg)
    peft_model = get_peft_model(model, lora.peft_config(cfg))
    names = lora.record_adapted(peft_model)
    assert names == ["q_proj"]
    peft_model.save_pretrained(tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["target_modules"] == ["q_proj"]


# ---- item 6: broken tokenizer and config files --------------------------------------------


@pytest.mark.parametrize("name", ["tokenizer.json", "generation_config.json", "tokenizer_config.json", "config.json"])
def test_a_truncated_tokenizer_or_config_file_is_refused_naming_the_file_and_the_parse_error(
    tmp_path, tiny_model_dir, name
):
    from tasks.core.preflight.checks import load_for_check, preflight_report
    from tests.test_preflight import CPU2

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    text = (model / name).read_text()
    (model / name).write_text(text[: len(text) * 2 // 3])
    cfg = load_for_check(write_config(tmp_path / "c.yaml", tiny_config_raw(model, tmp_path / "run")))
    report = preflight_report(cfg, machine=CPU2)
    msgs = _problems(report, "base_model.uri")
    assert any(f"{model / name} is not valid JSON" in m and "line " in m and "column " in m for m in msgs), (
        report.text()
    )


def test_a_tokenizer_json_that_parses_but_is_no_tokenizer_is_refused(tmp_path, tiny_model_dir):
    from tasks.core.preflight.checks import load_for_check, preflight_report
    from tests.test_preflight import CPU2

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "NoSuchModel"}}))
    report = preflight_report(
        load_for_check(write_config(tmp_path / "c.yaml", tiny_config_raw(model, tmp_path / "run"))), machine=CPU2
    )
    assert any(
        "tokenizer.json parses as JSON but is not a tokenizer" in m for m in _problems(report, "base_model.uri")
    ), report.text()


# ---- item 11: files that are not what their name says ---------------------------------------


def sentencepiece_model() -> bytes:
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([f"the quick brown fox jumps over the lazy dog {i}" for i in range(100)]),
        model_writer=buf,
        vocab_size=40,
        minloglevel=2,
    )
    return buf.getvalue()


def hostile_model(tiny_model_dir: Path, dest: Path) -> Path:
    """The demo model with a GGUF file named tokenizer.model, a GGUF weight file and a stray shard."""
    shutil.copytree(tiny_model_dir, dest)
    (dest / "tokenizer.model").write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(4096))
    (dest / "model-q4.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(64))
    shutil.copyfile(dest / "model.safetensors", dest / "consolidated.safetensors")
    return dest


def test_the_folder_rule_knows_a_sentencepiece_model_from_an_impostor(tmp_path):
    from tasks.core.models.folder import misnamed, sentencepiece_problem

    (tmp_path / "good.model").write_bytes(sentencepiece_model())
    assert sentencepiece_problem(tmp_path / "good.model") is None
    (tmp_path / "cut.model").write_bytes(sentencepiece_model()[:300])
    assert "runs past the end of the file" in sentencepiece_problem(tmp_path / "cut.model")
    (tmp_path / "tokenizer.model").write_bytes(b"GGUF" + bytes(100))
    assert "it is a GGUF file" in misnamed(tmp_path)["tokenizer.model"]
    assert "good.model" not in misnamed(tmp_path)


def test_files_that_are_not_what_their_name_says_are_named_in_preflight(tmp_path, tiny_model_dir):
    from tasks.core.preflight.checks import load_for_check, preflight_report
    from tests.test_preflight import CPU2

    model = hostile_model(tiny_model_dir, tmp_path / "model")
    report = preflight_report(
        load_for_check(write_config(tmp_path / "c.yaml", tiny_config_raw(model, tmp_path / "run"))), machine=CPU2
    )
    text = "\n".join(report.warnings)
    assert (
        f"{model / 'tokenizer.model'} is named like a SentencePiece tokenizer model, but it is a GGUF file" in text
    ), report.text()
    assert f"{model / 'model-q4.gguf'} is weights in a format no HF loader reads" in text
    assert f"{model / 'consolidated.safetensors'} is a .safetensors file that is not a weight shard" in text
    assert "load_from_hf leaves it out of base/" in text


def test_the_folder_rule_refuses_an_impostor_tokenizer_model_in_an_export(tmp_path, tiny_model_dir):
    """Verify and push apply folder_problems: a GGUF tokenizer.model in an export is refused."""
    from tasks.core.hub.card import usage_snippet  # noqa: F401 - the push's module imports cleanly with the rule
    from tasks.core.models.folder import folder_problems

    export = tmp_path / "export"
    shutil.copytree(tiny_model_dir, export)
    assert folder_problems(export) == []
    (export / "tokenizer.model").write_bytes(b"GGUF" + bytes(100))
    assert any(
        "holds tokenizer.model: named like a SentencePiece tokenizer model, but it is a GGUF file" in p
        for p in folder_problems(export)
    )


@pytest.mark.integration
def test_load_from_hf_leaves_out_files_that_are_not_what_their_name_says(prefect_harness, tiny_model_dir, tmp_path):
    """The GGUF tokenizer.model, the GGUF weights and the stray shard never reach base/, nor (through
    the tokenizer copy) cpt/hf/ and export/; the manifest names them."""
    from tasks.core.config.load import load_config
    from tasks.core.models.hf_artifact import copy_tokenizer
    from tasks.core.run.manifest import verify_artifact
    from tasks.stages.load import load_from_hf

    model = hostile_model(tiny_model_dir, tmp_path / "model")
    cfg = load_config(write_config(tmp_path / "c.yaml", tiny_config_raw(model, tmp_path / "run")))
    state = load_from_hf(cfg, return_state=True)
    assert state.is_completed(), state.message
    base = tmp_path / "run" / "base"
    manifest = verify_artifact(base)
    for name in ("tokenizer.model", "model-q4.gguf", "consolidated.safetensors"):
        assert not (base / name).exists() and name not in manifest["files"], name
        assert name in manifest["meta"]["left_out"], manifest["meta"]
    assert (base / "tokenizer.json").is_file() and (base / "model.safetensors").is_file()
    downstream = tmp_path / "export"
    downstream.mkdir()
    assert "tokenizer.model" not in copy_tokenizer(
        model, downstream
    )  # a base/ built before the rule: its impostor stays behind
    assert not (downstream / "tokenizer.model").exists() and (downstream / "tokenizer.json").is_file()


# ---- item 12: no user file is deleted; --check writes nothing ------------------------------


@pytest.mark.integration
def test_a_hand_made_folder_in_an_artifacts_place_is_moved_aside_never_emptied(
    prefect_harness, tiny_model_dir, tmp_path
):
    from tasks.core.config.load import load_config
    from tasks.core.run.manifest import verify_artifact
    from tasks.stages.load import load_from_hf

    run = tmp_path / "run"
    (run / "base").mkdir(parents=True)
    (run / "base" / "my-notes.txt").write_text("mine")
    cfg = load_config(write_config(tmp_path / "c.yaml", tiny_config_raw(tiny_model_dir, run)))
    assert load_from_hf(cfg, return_state=True).is_completed()
    kept = list(run.glob("base.superseded-*"))
    assert len(kept) == 1 and (kept[0] / "my-notes.txt").read_text() == "mine"
    verify_artifact(run / "base")
    # The flow's own artifact, rebuilt under another config, is replaced as before; a file a user added to it is kept.
    (run / "base" / "added-by-hand.txt").write_text("also mine")
    raw = tiny_config_raw(tiny_model_dir, run)
    raw["base_model"]["allow_pickle"] = True  # digested: the stage runs again
    cfg2 = load_config(write_config(tmp_path / "c2.yaml", raw))
    assert load_from_hf(cfg2, return_state=True).is_completed()
    assert any((k / "added-by-hand.txt").is_file() for k in run.glob("base.superseded-*"))


def test_check_writes_nothing_not_even_the_run_root(tmp_path, tiny_model_dir, capsys):
    from flows.cli import main

    run = tmp_path / "runs" / "new-run"
    path = write_config(tmp_path / "c.yaml", tiny_config_raw(tiny_model_dir, run))
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert main(["check", "--config", str(path)]) == 0, capsys.readouterr().out
    assert "probe object written, read back and deleted" in capsys.readouterr().out
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before and not run.parent.exists()


# ---- item 5: a full disk is one line, run.json records it, no temporary file outlives it ----


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real tmpfs of 20 MB (root can mount one): a disk that fills up."""
    import subprocess

    mnt = tmp_path / "disk"
    mnt.mkdir()
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mnt)], check=False, capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("cannot mount a tmpfs here (needs root): the full-disk cases need a real small filesystem")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_on_a_full_disk_writes_leave_no_temporary_file_and_run_json_is_rewritten_in_place(small_tmpfs):
    import errno

    from tasks.core.run.manifest import write_atomic
    from tasks.core.storage.oserrors import describe, overwrite_in_place

    record = small_tmpfs / "run.json"
    write_atomic(record, json.dumps({"stages": ["old"] * 200}))
    with open(small_tmpfs / "filler", "wb", buffering=0) as f:  # fill the disk to the last block
        for chunk in (1 << 20, 4096):
            try:
                while True:
                    f.write(bytes(chunk))
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
    with pytest.raises(OSError) as full:
        write_atomic(record, json.dumps({"stages": ["new"] * 200}))
    assert full.value.errno == errno.ENOSPC and sorted(p.name for p in small_tmpfs.iterdir()) == ["filler", "run.json"]
    assert overwrite_in_place(record, json.dumps({"stages": ["failed"]}))
    assert json.loads(record.read_text()) == {"stages": ["failed"]}
    assert not overwrite_in_place(record, "x" * (1 << 20))  # does not fit in its blocks: left whole
    line = describe(errno.ENOSPC, small_tmpfs / "base" / "model.safetensors", need=30_000_000)
    assert (
        f"No space left on device (ENOSPC) writing {small_tmpfs}/base/model.safetensors on {small_tmpfs} (tmpfs, "
        in line
    )
    assert (
        "0 B free of 21.0 MB; the run needs about 30.0 MB there in all" in line
        and "point run_root at a larger disk" in line
    )
    assert "\n" not in line


@pytest.mark.integration
def test_a_full_disk_during_a_stage_is_one_line_and_run_json_records_it(
    prefect_harness, tiny_model_dir, small_tmpfs, tmp_path, capsys
):
    """Pre-flight's estimate (18.8 MB) fits the 20 MB disk; a base model with a 24 MB extra file
    fills it while load_from_hf copies: the failure names the file, the filesystem, free and needed
    space and the fix, once, without a retry; run.json records it; no temporary file is left."""
    from flows.cli import flow_main as main

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "original").mkdir()
    (model / "original" / "notes.txt").write_bytes(bytes(24 << 20))
    run = small_tmpfs / "run"
    cfg = write_config(tmp_path / "c.yaml", tiny_config_raw(model, run))
    assert main(["--config", str(cfg), "--stop-after", "load_from_hf"]) == 1
    out = capsys.readouterr()
    summary = json.loads((run / "run.json").read_text())
    (row,) = [s for s in summary["stages"] if s["stage"] == "load_from_hf"]
    error = row["detail"]["error"]
    assert row["status"] == "failed" and error.startswith("OSError: No space left on device (ENOSPC) writing ")
    assert (
        "original/notes.txt on " + str(small_tmpfs) + " (tmpfs, 0 B free when it failed, 21.0 MB free of 21.0 MB now"
        in error
    ), error
    assert "the run needs about 18.8 MB" in error
    assert error in out.out + out.err
    assert not [
        p.name for p in run.iterdir() if p.name.endswith((".tmp", ".tmp-build")) or p.name.startswith(".run.json")
    ], list(run.iterdir())


def test_a_ranks_disk_error_is_said_at_the_stage_directory(tmp_path):
    """A rank's error comes back as text ("rank 0: OSError: [Errno 28] ..."), with no file name: the
    stage's directory is the place named; an error that is not the disk's is left to the usual cause."""
    from tasks.core.errors import StageFailed
    from tasks.core.storage.oserrors import stage_cause

    failed = StageFailed("rank 0: OSError: [Errno 28] No space left on device\n...last lines...")
    line = stage_cause(failed, tmp_path / "cpt", need=10**9)
    assert (
        line.startswith(f"StageFailed: No space left on device (ENOSPC) writing {tmp_path / 'cpt'} on ")
        and "the run needs about 1.0 GB" in line
    )
    assert stage_cause(StageFailed("rank 0: ValueError: bad shape"), tmp_path) is None
    assert stage_cause(FileNotFoundError(2, "No such file or directory", "x.jsonl"), tmp_path) is None
    ro = stage_cause(OSError(30, "Read-only file system", str(tmp_path / "run.json")), tmp_path)
    assert f"Read-only file system (EROFS) writing {tmp_path / 'run.json'}" in ro and "remount it read-write" in ro


@pytest.mark.integration
def test_load_from_hf_refuses_a_broken_json_file_naming_it_where_preflight_could_not_read_it(
    prefect_harness, tiny_model_dir, tmp_path
):
    """A Hub model's tokenizer.json is first read in load_from_hf: the stage refuses it there, naming
    the file and the parse error, and is not retried (the same check as pre-flight's, on base/)."""
    from tasks.core.config.load import load_config
    from tasks.stages.load import load_from_hf

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    text = (model / "tokenizer.json").read_text()
    (model / "tokenizer.json").write_text(text[: len(text) // 2])
    cfg = load_config(write_config(tmp_path / "c.yaml", tiny_config_raw(model, tmp_path / "run")))
    state = load_from_hf(cfg, return_state=True)
    assert state.is_failed() and state.name == "Failed", state.name  # not "Retrying": a broken file does not heal
    assert "tokenizer.json is not valid JSON" in state.message and "line " in state.message, state.message


def test_preflight_does_not_judge_work_moved_aside(tmp_path):
    """A superseded folder is the user's, kept, never read by the run: its stray shard is no problem,
    while the same folder in an artifact's place is refused."""
    from tests.test_preflight import make_manifest

    case = Case(tmp_path)
    art = make_manifest(
        case.run_root, "export.superseded-20260101T000000Z", {"model.safetensors": {"size": 0, "sha256": "0" * 64}}
    )
    (art / "model.safetensors").write_bytes(b"")
    (art / "extra.safetensors").write_bytes(b"")
    assert not [p for p in case.report().problems if "superseded" in p[0]], case.report().text()
    art.rename(case.run_root / "export")
    assert any("extra.safetensors" in m for _, m in case.report().problems)
