"""The whole flow on the tiny config, in-process on an ephemeral Prefect server (e2e tier).

The tests that only read a finished run read the session's demo run (tests/conftest.py
`demo_run`: the same config and base model, straight through). One module-scoped scenario
serves the others, because a flow run costs minutes on 2 cores:
  1. a run whose SFT stage dies (rank 1 SIGKILLed after step 5; the step-4 checkpoint is complete):
     exit status 1, and the cause (rank 1's error line) in run.json, the failed-stage event and
     the CLI's last line;
  2. the retry over the same run root: the first five stages are skipped without a launch, SFT
     resumes from step 4 and the run completes;
  3. a re-run of the complete run: every stage skipped, no torchrun process at all;
  4. the same run root with an impossible gate threshold: only the gate is decided anew, it fails,
     the push is skipped and the flow run ends Completed, named "FailedGate";
  5. the same with `gate.enabled: false`: the push runs again, the run is complete;
  6. a copy of the run root with `export.align_stop_tokens: false`: only export, evaluate_sft and the
     gate run again, and the gate fails naming the fix.
The base model's generation_config eos is the document end only (<|end_of_text|>), not the chat
template's end of turn (<|im_end|>), like a pre-trained base fine-tuned with ChatML: the export
adds it, and the greedy generations of the export stop.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import subprocess
import sys

import pytest
import torch

from tasks.core.run.manifest import MANIFEST, PROVENANCE_DIR
from tests._consumer_rules import assert_consumer_rules
from tests.conftest import tiny_config_raw, write_config

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

STAGE_DIRS = {
    "load_from_hf": "base",
    "prepare_cpt": "data/cpt",
    "prepare_sft": "data/sft",
    "boost_and_shard": "cpt/step-000000",
    "train_cpt": "cpt/step-000008",
    "unshard": "cpt/hf",
    "evaluate_cpt": "eval/cpt",
    "reboost": "sft/step-000000",
    "train_sft": "sft/step-000008",
    "export": "export",
    "evaluate_sft": "eval/sft",
}
UPSTREAM = tuple(STAGE_DIRS)  # every stage that leaves an artifact (all but gate and push)


class Launches:
    """Wraps tasks.stages.train.run_engine: records every engine launch and the steps it trained."""

    def __init__(self, real):
        self.real, self.calls = real, []

    def __call__(self, verb, job, *args, **kwargs):
        progress = self.real(verb, job, *args, **kwargs)
        self.calls.append({"verb": verb, "phase": job.phase, "steps": [int(p["step"]) for p in progress]})
        return progress


class Events:
    """Wraps tasks.flowkit.automation.stage_event: records every stage event's payload, then sends it."""

    def __init__(self, real):
        self.real, self.calls = real, []

    def __call__(self, stage, status, run_name, uri, **payload):
        self.calls.append({"stage": stage, "status": str(status), **payload})
        return self.real(stage, status, run_name, uri, **payload)


@pytest.fixture(scope="module")
def scenario(prefect_harness, eos_doc_end_model, tmp_path_factory):
    import tasks.flowkit.automation
    import tasks.flowkit.ui
    import tasks.stages.train
    from flows.cli import flow_main as main

    tiny_model_dir = eos_doc_end_model
    tmp = tmp_path_factory.mktemp("e2e")
    run_root = tmp / "run"
    cfg = write_config(tmp / "tiny.yaml", tiny_config_raw(tiny_model_dir, run_root))
    mp = pytest.MonkeyPatch()
    runs = []
    try:
        for fault in ("kill@step=5@phase=sft", "", ""):
            launches = Launches(
                tasks.stages.train.run_engine.__wrapped__
                if hasattr(tasks.stages.train.run_engine, "__wrapped__")
                else tasks.stages.train.run_engine
            )
            mp.setattr(tasks.stages.train, "run_engine", launches)
            events = Events(tasks.flowkit.automation.stage_event)
            mp.setattr(tasks.flowkit.automation, "stage_event", events)
            hashed = _count_hashes(mp)
            mp.setenv("CPT_TO_SFT_FAULT", fault) if fault else mp.delenv("CPT_TO_SFT_FAULT", raising=False)
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                rc = main(["--config", str(cfg)])
            summary = json.loads((run_root / "run.json").read_text())
            last = [x for x in err.getvalue().splitlines() if x.strip()][-1:] or [""]
            runs.append(
                {
                    "rc": rc,
                    "launches": launches.calls,
                    "summary": summary,
                    "events": events.calls,
                    "last_line": last[0],
                    "hashed": list(hashed),
                }
            )
            mp.setattr(tasks.stages.train, "run_engine", launches.real)
            mp.setattr(tasks.flowkit.automation, "stage_event", events.real)
        runs += _gate_reruns(mp, tmp, tiny_model_dir, run_root)
        runs.append(_unaligned_rerun(mp, tmp, tiny_model_dir, run_root))
    finally:
        mp.undo()
    return run_root, runs


def _count_hashes(mp) -> list[str]:
    """Every artifact file the flow process hashes against a manifest from now on (engine ranks are
    other processes and hash their own resume checkpoint)."""
    import tasks.core.run.manifest as manifest_mod
    import tasks.stages.load

    seen: list[str] = []
    real = getattr(manifest_mod.sha256_file, "real", manifest_mod.sha256_file)

    def counting(path):
        seen.append(str(path))
        return real(path)

    counting.real = real
    mp.setattr(manifest_mod, "sha256_file", counting)
    mp.setattr(tasks.stages.load, "sha256_file", counting)  # load_from_hf's check of the HF files it copies
    return seen


def _gate_reruns(mp, tmp, model_dir, run_root):
    """Steps 4 and 5: only the gate config changes; gate config is in no artifact's digest."""
    import flows.cpt_to_sft as flow_mod
    import tasks.stages.train
    from flows.cli import flow_main
    from tasks.flowkit import pipeline

    out = []
    for name, gate in (
        ("failing", {"cpt_max_ppl_increase_pct": -100.0}),
        ("disabled", {"cpt_max_ppl_increase_pct": -100.0, "enabled": False}),
    ):
        raw = tiny_config_raw(model_dir, run_root)
        raw["gate"].update(gate)
        cfg = write_config(tmp / f"tiny-gate-{name}.yaml", raw)
        launches, pushes = Launches(tasks.stages.train.run_engine), []
        real_push = pipeline.TASKS["push_to_hub"]
        mp.setattr(tasks.stages.train, "run_engine", launches)
        mp.setitem(pipeline.TASKS, "push_to_hub", _counting_push(real_push, pushes))
        if name == "failing":
            state = flow_mod.cpt_to_sft(config=str(cfg), return_state=True)
            out.append(
                {
                    "state": state,
                    "rc": None,
                    "launches": launches.calls,
                    "pushes": pushes,
                    "summary": json.loads((run_root / "run.json").read_text()),
                }
            )
        else:
            rc = flow_main(["--config", str(cfg)])
            out.append(
                {
                    "rc": rc,
                    "launches": launches.calls,
                    "pushes": pushes,
                    "summary": json.loads((run_root / "run.json").read_text()),
                }
            )
        mp.setattr(tasks.stages.train, "run_engine", launches.real)
        mp.setitem(pipeline.TASKS, "push_to_hub", real_push)
    return out


def _counting_push(real_push, pushes: list):
    """push_to_hub as a task that records each call's gate.enabled, then runs the real one."""
    from prefect import task

    from tasks.flowkit.stage import outcome

    @task(name="push_to_hub")
    def push(cfg_, results):
        pushes.append(cfg_.gate.enabled)
        return outcome(real_push(cfg_, results, return_state=True))  # its StageResult, a skip included

    return push


def _unaligned_rerun(mp, tmp, model_dir, run_root):
    """Step 6, on a copy so the finished run's export stays the aligned one."""
    import flows.cpt_to_sft as flow_mod
    import tasks.stages.train

    copy = tmp / "run-unaligned"
    shutil.copytree(run_root, copy, ignore=shutil.ignore_patterns(".lease.json"))
    raw = tiny_config_raw(model_dir, copy)
    raw["export"]["align_stop_tokens"] = False
    cfg = write_config(tmp / "tiny-unaligned.yaml", raw)
    launches = Launches(tasks.stages.train.run_engine)
    mp.setattr(tasks.stages.train, "run_engine", launches)
    state = flow_mod.cpt_to_sft(config=str(cfg), return_state=True)
    mp.setattr(tasks.stages.train, "run_engine", launches.real)
    return {
        "state": state,
        "launches": launches.calls,
        "summary": json.loads((copy / "run.json").read_text()),
        "run_root": copy,
    }


@pytest.fixture(scope="module")
def finished_run(demo_run):
    """The session's finished demo run (tests/conftest.py), read only: the same config and base
    model as the scenario, run straight through."""
    assert demo_run.rc == 0, demo_run.summary
    return demo_run.run_root, demo_run.config


def statuses(summary):
    return {s["stage"]: s["status"] for s in summary["stages"]}


def test_failed_sft_run_is_recorded_with_its_cause(scenario):
    _, runs = scenario
    first = runs[0]
    assert first["rc"] == 1 and first["summary"]["complete"] is False
    st = statuses(first["summary"])
    assert st["train_cpt"] == "completed" and st["train_sft"] == "failed" and st["export"] == "not-run"
    # The cause is rank 1's own last words (at error level), not "exited with status 1":
    # in run.json's stage row, the failed-stage event and the CLI's last line.
    cause = (
        "rank 1: injected fault 'kill@step=5@phase=sft' (CPT_TO_SFT_FAULT): rank 1 SIGKILLs itself after step "
        "5 of phase sft"
    )
    row = next(s for s in first["summary"]["stages"] if s["stage"] == "train_sft")
    assert row["detail"]["error"] == f"StageFailed: {cause}", row
    (event,) = [e for e in first["events"] if e["status"] == "failed"]
    assert event["stage"] == "train_sft" and event["cause"] == f"StageFailed: {cause}"
    assert (
        event["error"].startswith(f"StageFailed: engine verb 'train' failed on {cause}")
        and "last lines per process" in event["error"]
    )
    assert first["last_line"] == f"stage train_sft failed: StageFailed: {cause}"
    # The kill hit the shared launch (tasks/core/launch/shared.py): reboost started it, train_sft adopted it,
    # so no stage of this run called run_engine; the retry resumes in a launch of its own (next test).
    assert first["launches"] == [], first["launches"]
    rows = {s["stage"]: s for s in first["summary"]["stages"]}
    assert rows["reboost"]["detail"]["launch"] == "shared" and rows["train_cpt"]["detail"]["launch"] == "adopted"


def test_retry_skips_done_stages_and_resumes_sft(scenario):
    _, runs = scenario
    retry = runs[1]
    assert retry["rc"] == 0 and retry["summary"]["complete"] is True
    st = statuses(retry["summary"])
    for stage in (
        "load_from_hf",
        "prepare_cpt",
        "prepare_sft",
        "boost_and_shard",
        "train_cpt",
        "unshard",
        "evaluate_cpt",
        "reboost",
    ):
        assert st[stage] == "skipped", (stage, st)
    assert st["train_sft"] == "completed" and st["export"] == "completed" and st["evaluate_sft"] == "completed"
    assert st["gate"] == "passed" and retry["summary"]["gate"]["passed"] is True
    # Only SFT training was launched, and it continued after the step-4 checkpoint.
    assert [(c["verb"], c["phase"]) for c in retry["launches"]] == [("train", "sft")]
    assert retry["launches"][0]["steps"] == [5, 6, 7, 8]


def test_rerun_of_complete_run_launches_nothing(scenario):
    _, runs = scenario
    rerun = runs[2]
    assert rerun["rc"] == 0 and rerun["launches"] == []
    st = statuses(rerun["summary"])
    assert st.pop("gate") == "passed"  # a decision over recorded metrics, taken on every run
    assert set(st.values()) <= {"skipped", "not-configured"}, st
    # Each skip decision trusted its artifact's verification stamp: no byte of any artifact was
    # read again (the runs before it hashed every artifact they built or read).
    assert rerun["hashed"] == [] and runs[0]["hashed"] and runs[1]["hashed"], rerun["hashed"][:5]


def test_each_train_stage_adopted_the_launch_its_shard_stage_started(finished_run):
    """Two launches for four engine verbs: boost_and_shard and reboost each started one (verb shard-train),
    committed and verified step 0 as stages of their own, and the train stage after each trained in it."""
    run_root, _ = finished_run
    rows = {s["stage"]: s for s in json.loads((run_root / "run.json").read_text())["stages"]}
    for shard, train, phase in (("boost_and_shard", "train_cpt", "cpt"), ("reboost", "train_sft", "sft")):
        assert rows[shard]["status"] == rows[train]["status"] == "completed", (rows[shard], rows[train])
        assert rows[shard]["detail"]["launch"] == "shared" and rows[train]["detail"]["launch"] == "adopted"
        # the hand-off the train stage wrote names its own job file, which the ranks read
        go = json.loads((run_root / "jobs" / f"{phase}-shard.json.go").read_text())
        assert go == {"job": str(run_root / "jobs" / f"{phase}-train.json"), "fault": ""}, go
        # each row keeps its own CPU: the ranks' shard part is the shard stage's, though reaped in training
        assert rows[shard]["cpu_children_seconds"] > 1.0 and rows[train]["cpu_children_seconds"] > 1.0


def test_stop_after_boost_and_shard_stops_the_shared_launch_and_a_launch_of_its_own_trains_bitwise(demo_run_copy):
    """On a copy of the demo run with CPT's checkpoints moved aside: `--stop-after boost_and_shard` ends
    after the shard stage of a shared launch (the ranks told to stop, nothing trained), and step 0 is the
    demo's, bitwise; then train_cpt, its shard stage skipped, launches on its own from step 0 and its
    eight losses and step-8 weights are the demo's (trained in the shared launch), bitwise. Two launches."""
    from flows.cli import flow_main
    from support.engine import read_model_dir

    copy = demo_run_copy
    cpt, ref = copy.run_root / "cpt", copy.run_root.parent / "ref"
    ref.mkdir()
    for name in ("step-000000", "step-000004", "step-000008"):
        (cpt / name).rename(ref / name)

    def run(stop_after):
        with console_capture_quiet():
            rc = flow_main(["--config", str(copy.config), "--stop-after", stop_after])
        summary = json.loads((copy.run_root / "run.json").read_text())
        return rc, summary, {s["stage"]: s for s in summary["stages"]}

    rc, summary, rows = run("boost_and_shard")
    assert rc == 0 and summary["stopped_after"] == "boost_and_shard", rows["boost_and_shard"]
    assert rows["boost_and_shard"]["status"] == "completed" and rows["boost_and_shard"]["detail"]["launch"] == "shared"
    assert rows["train_cpt"]["status"] == "not-run" and not (cpt / "step-000001").exists()
    go = json.loads((copy.run_root / "jobs" / "cpt-shard.json.go").read_text())
    assert go["stop"].startswith("the run ended before its train stage adopted the launch"), go
    got, want = read_model_dir(cpt / "step-000000" / "model"), read_model_dir(ref / "step-000000" / "model")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)

    rc, summary, rows = run("train_cpt")
    assert rc == 0 and rows["boost_and_shard"]["status"] == "skipped", rows["boost_and_shard"]
    assert rows["train_cpt"]["status"] == "completed" and rows["train_cpt"]["detail"]["launch"] == "own"
    state = json.loads((cpt / "step-000008" / "train_state.json").read_text())
    assert state["losses"] == json.loads((ref / "step-000008" / "train_state.json").read_text())["losses"]
    got, want = read_model_dir(cpt / "step-000008" / "model"), read_model_dir(ref / "step-000008" / "model")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


@contextlib.contextmanager
def console_capture_quiet():
    """The flow's console output kept out of the test's (its log is in the Prefect server's)."""
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        yield


def test_every_stage_has_a_verified_artifact(finished_run):
    from tasks.core.run.manifest import manifest_digest, verify_artifact

    run_root, _ = finished_run
    summary = json.loads((run_root / "run.json").read_text())
    assert summary["complete"] is True
    by_stage = {s["stage"]: s for s in summary["stages"]}
    for stage, rel in STAGE_DIRS.items():
        verify_artifact(run_root / rel)
        assert by_stage[stage]["status"] in ("completed", "skipped"), by_stage[stage]
        assert by_stage[stage]["digest"] == manifest_digest(run_root / rel)
        assert by_stage[stage]["uri"].endswith(rel)
    assert by_stage["push_to_hub"]["status"] == "not-configured"
    assert summary["export"].endswith("export")


def test_cpt_loss_decreases_and_sft_starts_from_cpt(finished_run):

    from tasks.core.models.convert import load_state_dict_from_dir

    run_root, _ = finished_run
    cpt = json.loads((run_root / "cpt/step-000008/train_state.json").read_text())["losses"]
    assert len(cpt) == 8 and cpt[-1] < cpt[0]
    # The reboost stage loaded exactly the unsharded CPT weights (cast to plugin B's bf16).
    bridge = load_state_dict_from_dir(run_root / "cpt/hf")
    sft0 = load_state_dict_from_dir(run_root / "sft/step-000000/model")
    assert set(sft0) == set(bridge)
    for key, tensor in bridge.items():
        assert torch.equal(sft0[key].float(), tensor.to(sft0[key].dtype).float()), key
    manifest = json.loads((run_root / "sft/step-000000" / MANIFEST).read_text())
    assert manifest["parent"]["uri"].endswith("cpt/hf")


def test_export_is_a_clean_model_folder_with_matching_logits(finished_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tasks.core.models.fingerprint import load_fingerprint, model_logits

    run_root, _ = finished_run
    export = run_root / "export"
    # transformers >= 4.52 saves the tokenizer's chat template beside tokenizer_config.json
    names = {p.name for p in export.iterdir()} - {"chat_template.jinja"}
    # Model files and the card only; the provenance is in its subfolder, and no *.safetensors but the weights.
    assert names == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "README.md",
        PROVENANCE_DIR,
    }, names
    # The verification stamp (tasks/core/run/stamp.py) sits beside them, listed in no manifest, never pushed.
    assert {p.name for p in (export / PROVENANCE_DIR).iterdir()} == {
        "manifest.json",
        "verification.json",
        "fingerprint.npy",
        "verified-stamp.json",
    }
    assert_consumer_rules(export)
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(export)
    assert tok.chat_template and "assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    logits = model_logits(model, model.config.vocab_size)
    reference = load_fingerprint(run_root / "sft/step-000008")
    verification = json.loads((export / PROVENANCE_DIR / "verification.json").read_text())
    assert verification["fingerprint_match"] and verification["top1_disagreements_beyond_tolerance"] == 0
    assert (
        float((logits - reference).abs().max())
        <= verification["fingerprint_rtol"] * verification["fingerprint_max_abs_logit"]
    )
    assert verification["weights_bitwise"]["tensors"] == verification["tensors"] == len(list(model.parameters()))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_export_stops_at_the_templates_end_of_turn_and_the_gate_passes(scenario):
    run_root, runs = scenario
    export = run_root / "export"
    gen = json.loads((export / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [1, 4] and gen["pad_token_id"] == 2  # base <|end_of_text|> + <|im_end|>; <|pad|>
    stop = json.loads((export / PROVENANCE_DIR / "verification.json").read_text())["stop_tokens"]
    assert stop["base_eos_token_id"] == [1] and [(a["id"], a["token"]) for a in stop["added"]] == [(4, "<|im_end|>")]
    finished = runs[1]["summary"]
    generation = finished["evaluation"]["sft"]["generation"]
    assert generation["stopped"] == generation["prompts"] and not generation["problems"], generation
    assert finished["gate"]["passed"] is True
    assert {c["check"]: c["ok"] for c in finished["gate"]["checks"]}.get("generation_stops") is True


def test_without_stop_token_alignment_the_gate_fails_naming_the_fix(scenario):
    unaligned = scenario[1][5]
    st = statuses(unaligned["summary"])
    assert unaligned["launches"] == [] and st["export"] == "completed" and st["evaluate_sft"] == "completed", st
    assert all(st[s] == "skipped" for s in UPSTREAM if s not in ("export", "evaluate_sft")), st
    assert unaligned["state"].name == "FailedGate"
    reasons = " ".join(unaligned["summary"]["gate"]["reasons"])
    assert (
        "lacks the chat template's end-of-turn token '<|im_end|>'" in reasons
        and "export.align_stop_tokens: true" in reasons
    ), reasons
    assert json.loads((unaligned["run_root"] / "export" / "generation_config.json").read_text())["eos_token_id"] == 1


def test_card_has_the_hyperparameters_versions_and_a_usage_snippet_that_runs(finished_run, capsys):
    """A run without `hub:` leaves its model card in export/ (listed by the export's manifest, as
    the push would send it); `cpt-to-sft card` renders the same bytes again; its snippet loads the
    export in the export's own dtype."""
    import hashlib

    from huggingface_hub import ModelCard

    from flows.cli import main as cli
    from tasks.core.run.manifest import read_manifest, verify_artifact

    run_root, _ = finished_run
    summary = json.loads((run_root / "run.json").read_text())
    manifest = verify_artifact(run_root / "export")
    export_row = next(s for s in summary["stages"] if s["stage"] == "export")
    assert (
        manifest["views"] == ["README.md"]
        and export_row["digest"] == hashlib.sha256((run_root / "export" / MANIFEST).read_bytes()).hexdigest()
    )
    card = (run_root / "export" / "README.md").read_text()
    data = ModelCard(card).data  # a local base: no Hub id (its folder's name is none), its manifest digest
    assert (
        data.base_model is None
        and "the model folder `tiny-llama-eos`" in card
        and data.base_model_manifest_digest == hashlib.sha256((run_root / "base" / MANIFEST).read_bytes()).hexdigest()
    )
    assert "| peak memory (largest rank) |" in card and ", dtype=torch.bfloat16)" in card  # the demo exports bf16
    copy = run_root.parent / "card-copy"  # `card` writes: into a copy of the export and run.json, not the session's run
    if not copy.exists():
        shutil.copytree(run_root, copy, ignore=shutil.ignore_patterns(".lease.json"))
    assert cli(["card", str(copy)]) == 0 and capsys.readouterr().out.strip() == f"{copy}/export/README.md: unchanged"
    assert read_manifest(copy / "export") == manifest
    tokens = json.loads((run_root / "sft/step-000008/train_state.json").read_text())["tokens_seen"]
    data_sha = json.loads((run_root / "cpt/data-split.json").read_text())["inputs"][0]["checksum"]
    for words in (
        "`hybrid_parallel` tp=2",
        "`low_level_zero`",
        "AdamW lr 0.003",
        "cosine, warm-up 3",
        "4 × 1 accum × 1 dp = 4 sequences",
        "4 × 1 accum × 2 dp = 8 sequences",
        f"{tokens:,}",
        data_sha,
        "| seq_len | 64 | 128 |",
        "SFT held-out loss",
        f"torch {torch.__version__}",
        "colossalai 0.5.0",
        "transformers ",
        "bitwise",
        "`<|im_end|>` (4)",
    ):
        assert words in card, words
    assert (
        "| batching | full blocks | padded |" in card
        and "| median padding (share of computed tokens) | 0.0 % |" in card
    ), card
    # The held-out-only source (demo_run's cpt.eval.heldout_sources): measured base vs CPT beside the
    # trained one, in metrics.json, run.json, the evaluation table (the card's) and the card's data.
    cpt = summary["evaluation"]["cpt"]
    assert cpt == json.loads((run_root / "eval/cpt/metrics.json").read_text())
    general, main = cpt["sources"]["general"], cpt["sources"]["main"]
    assert general["held_out_only"] is True and general["tokens"] > 0 and "held_out_only" not in main
    assert (
        main["cpt"] == cpt["cpt"] and main["base"] == cpt["base"]
    )  # one trained source: its held-out set is the pooled one
    row = (
        "| CPT held-out perplexity: general (held out only, never trained on) | base "
        f"{general['base']['perplexity']:.4f} | CPT {general['cpt']['perplexity']:.4f} |"
    )
    assert row in card and "CPT held-out-only sources (evaluated base vs CPT, never trained on):" in card, card
    assert "CPT held-out of source general (never trained on)" in card  # the model-index
    index = json.loads((run_root / "data/cpt/index.json").read_text())
    assert (
        index["heldout_sources"][0]["file"] == "heldout-sources/general.jsonl"
        and (run_root / "data/cpt/heldout-sources/general.jsonl").is_file()
    )
    snippet = re.search(r"```python\n(.*?)```", card, re.DOTALL).group(1)
    snippet = re.sub(r'model_id = ".*"', f"model_id = {str(run_root / 'export')!r}", snippet)
    snippet += (
        "\nimport json\nassert str(model.dtype) == 'torch.' + json.load(open(model_id + "
        "'/config.json'))['torch_dtype'], model.dtype\n"
    )
    out = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]


def test_bridge_is_bitwise_the_plugin_a_checkpoint_and_reproduces_its_logits(finished_run):
    from tasks.core.models.convert import load_state_dict_from_dir

    run_root, _ = finished_run
    saved = load_state_dict_from_dir(run_root / "cpt/step-000008/model")
    bridge = load_state_dict_from_dir(run_root / "cpt/hf")
    assert set(saved) == set(bridge)
    for key in saved:
        assert saved[key].dtype == bridge[key].dtype and torch.equal(saved[key], bridge[key]), key
    # The unshard stage compared plain transformers' logits with the live plugin-A (tp=2) logits.
    meta = json.loads((run_root / "cpt/hf" / MANIFEST).read_text())["meta"]["verification"]
    assert (
        meta["fingerprint_rel_diff"] <= 1e-5
        and meta["fingerprint_match"] is True
        and meta["weights_bitwise"]["tensors"] == len(saved)
    )


def test_evaluation_is_recorded_in_manifests_and_run_json(scenario):
    from tasks.core.config.paths import resolve_local
    from tasks.core.data.records import read_records
    from tasks.core.data.split import record_id
    from tasks.core.data.stage_data import heldout_records

    run_root, runs = scenario
    summary = runs[1]["summary"]  # the run that completed SFT, evaluation and the gate
    cpt = json.loads((run_root / "eval/cpt" / MANIFEST).read_text())["meta"]["metrics"]
    sft_manifest = json.loads((run_root / "eval/sft" / MANIFEST).read_text())
    sft = sft_manifest["meta"]["metrics"]
    assert summary["evaluation"] == {"cpt": cpt, "sft": sft, "benchmark": None}  # no benchmark.tasks in this scenario
    # CPT on the CPT domain: the held-out perplexity dropped below the base model's.
    assert cpt["cpt"]["perplexity"] < cpt["base"]["perplexity"] and cpt["perplexity_change_pct"] < 0, cpt
    assert sft["sft"]["loss"] < sft["pre_sft"]["loss"], sft
    assert cpt["tokens"] > 0 and sft["tokens"] > 0
    gen = sft["generation"]
    assert gen["prompts"] == 4 and gen["end_of_turn"]["token"] == "<|im_end|>" and 4 in gen["eos_token_id"]
    assert "generations.jsonl" in sft_manifest["files"]
    rows = [json.loads(line) for line in (run_root / "eval/sft/generations.jsonl").read_text().splitlines()]
    assert len(rows) == gen["prompts"] and all(r["prompt"][-1]["role"] == "user" for r in rows)
    # The split: recorded with the artifacts, and training never saw a held-out record.
    for stage, artifact, metrics in (("cpt", "cpt/hf", cpt), ("sft", "export", sft)):
        split = json.loads((run_root / artifact / MANIFEST).read_text())["meta"]["data_split"]
        assert split == metrics["split"] and split["method"] == "hash-fraction" and split["heldout_records"] >= 1
        # prepare_data decided the split in its one pass; the held-out records live in data/<phase>/.
        held = heldout_records(run_root / "data" / stage)
        held_ids = {record_id(r) for r in held}
        train = [r for r in read_records(resolve_local(split["data_uri"])) if record_id(r) not in held_ids]
        dropped = split["dropped_no_labels"] + (
            split["truncation"].get("dropped", 0) if stage == "sft" else 0
        )  # sft.truncation: drop
        assert len(train) == split["train_records"] + dropped and len(held) == split["heldout_records"]
        job = json.loads((run_root / "jobs" / f"{stage}-train.json").read_text())
        assert job["data_dir"] == str(run_root / "data" / stage)


def test_failed_gate_skips_the_push_and_a_disabled_gate_lets_it_through(scenario):
    from prefect.states import StateType

    _, runs = scenario
    failing, disabled = runs[3], runs[4]
    for run in (failing, disabled):
        st = statuses(run["summary"])
        assert run["launches"] == [] and all(st[s] == "skipped" for s in UPSTREAM), st  # only the gate re-decided
    # Failing: Completed (not a crash) named FailedGate, push not called, the reasons recorded.
    state = failing["state"]
    assert state.type == StateType.COMPLETED and state.name == "FailedGate"
    assert "gate failed, nothing pushed" in state.message and "CPT held-out perplexity" in state.message
    assert failing["pushes"] == []
    summary = failing["summary"]
    assert statuses(summary)["gate"] == "failed-gate" and statuses(summary)["push_to_hub"] == "failed-gate"
    assert summary["gate"]["passed"] is False and summary["complete"] is False
    assert len(summary["gate"]["reasons"]) == 1 and "allowed at most -100%" in summary["gate"]["reasons"][0]
    assert state.result()["gate"] == summary["gate"]
    # Disabled: the same failing check is reported, and push_to_hub runs (no hub here: not-configured).
    assert disabled["rc"] == 0 and disabled["pushes"] == [False]
    summary = disabled["summary"]
    assert statuses(summary)["gate"] == "disabled" and statuses(summary)["push_to_hub"] == "not-configured"
    assert summary["gate"]["passed"] is True and summary["complete"] is True
    assert [c["check"] for c in summary["gate"]["checks"] if not c["ok"]] == ["cpt_perplexity"]


def test_second_run_over_a_held_run_root_fails_naming_the_holder(demo_run_copy, capsys):
    from flows.cli import flow_main as main
    from tasks.core.storage.fs import RunStore
    from tasks.core.storage.lease import Lease

    run_root, cfg = demo_run_copy.run_root, demo_run_copy.config  # a copy: the lease is a write
    # A live holder (this very process) on this host: refused at once, naming it; no traceback.
    holder = Lease(RunStore(str(run_root)), holder="flow run other-writer (test)").acquire()
    try:
        assert main(["--config", str(cfg)]) == 1
    finally:
        holder.release()
    err = capsys.readouterr().err
    last = [x for x in err.splitlines() if x.strip()][-1]
    assert "is being written by flow run other-writer (test)" in last and "--break-lease" in last


def test_each_step_records_its_padding_and_the_stage_its_medians(finished_run):
    """CPT blocks are full; the demo run's SFT rows are padded to seq_len (`batching: padded`, see
    tiny_config_raw), most of it padding: in the step records (TensorBoard, the train state the card
    reads) and the stage's result."""
    from tasks.core.run.tbevents import read_scalars

    run_root, _ = finished_run
    summary = json.loads((run_root / "run.json").read_text())
    medians = {
        s["stage"]: s["detail"].get("medians") for s in summary["stages"] if s["stage"] in ("train_cpt", "train_sft")
    }
    for stage, steps in (("cpt", 8), ("sft", 8)):
        state = json.loads((run_root / f"{stage}/step-{steps:06d}/train_state.json").read_text())
        pads = state["step_metrics"]["padding_frac"]
        assert len(pads) == steps and all(0.0 <= p < 1.0 for p in pads), pads
        scalars = read_scalars(run_root / stage / "tensorboard")
        assert [round(v, 6) for _, v in scalars["perf/padding_frac"]] == pytest.approx(pads, abs=1e-6)
        assert all(v > 0 for _, v in scalars["perf/computed_tokens"])
        if stage == "sft":  # 8 rows a step (4 per rank, 2 ranks) of seq_len 128
            assert {v for _, v in scalars["perf/computed_tokens"]} == {8 * 128}
    assert medians["train_cpt"]["padding_frac"] == 0.0
    # The demo's chats average ~57 real tokens of seq_len 128: more than half of each step is padding.
    assert 0.4 < medians["train_sft"]["padding_frac"] < 0.7, medians


def test_the_console_reads_like_a_training_log_and_the_artifacts_keep_every_step(demo_run):
    """At most 80 console lines (the JSON line per step, every rank's info lines and the
    bitsandbytes warning per rank and launch made it ~210): per training stage a start line, a step
    line every `log_every` (5 in the demo config) and at the last step, an end line; the run ends
    with a table of the stages. Every step's figures are still in TensorBoard and train_state.json."""
    from tasks.core.run.stages import run_stages
    from tasks.core.run.tbevents import read_scalars

    STAGE_NAMES = [s.name for s in run_stages(("cpt", "sft"))]  # the demo trains no dpo

    lines = demo_run.console.splitlines()
    assert demo_run.rc == 0 and 20 < len(lines) <= 80, "\n".join(lines)
    text = demo_run.console
    assert "progress {" not in text and "gemm_4bit_forward" not in text and "[rank 1]" not in text, text
    for phase in ("cpt", "sft"):
        steps = [
            int(m.group(1))
            for m in re.finditer(
                rf"{phase}  step (\d+)/8 \| loss \d+\.\d{{3}} \| lr \S+ \| \S+ tok/s \| pad \d+% \| mem \d+\.\d GiB",
                text,
            )
        ]
        assert steps == [5, 8], (phase, text)
        assert re.search(rf"{phase}  start \| 8 steps \| .* \| a line every 5 steps", text)
        assert re.search(
            rf"{phase}  done  \| step 8/8 in \S+ \| loss \d+\.\d{{3}} → \d+\.\d{{3}} \| median \S+ tok/s at seq_len \d+ \| pad \d+% "
            r"\| peak mem \d+\.\d GiB \(rank [01]\)",
            text,
        )
        state = json.loads((demo_run.run_root / f"{phase}/step-000008/train_state.json").read_text())
        scalars = read_scalars(demo_run.run_root / phase / "tensorboard")
        assert len(state["losses"]) == 8 and [s for s, _ in scalars["train/loss"]] == list(range(1, 9))
        assert [s for s, _ in scalars["perf/peak_mem_rank"]] == list(range(1, 9)) and {
            v for _, v in scalars["perf/peak_mem_rank"]
        } <= {0.0, 1.0}
    table = lines[
        next(i for i, line in enumerate(lines) if re.match(r"stage\s+status\s+duration\s+CPU\s+key figure", line)) + 1 :
    ]
    assert [row.split()[0] for row in table[: len(STAGE_NAMES)]] == list(STAGE_NAMES)
    assert re.search(r"evaluate_cpt\s+completed\s+\S+\s+\S+\s+held-out perplexity \d+\.\d\d → \d+\.\d\d", text)
    assert re.search(r"export\s+completed\s+\S+\s+\S+\s+\d+\.\d kB bf16", text)
    assert any(line.startswith(f"artifacts: {demo_run.run_root}") for line in table)
    # CPU seconds per stage beside the wall seconds (tasks/core/run/cputime.py): a launch's ranks are in the
    # children's part, the flow process's own work (the evaluations' logits) in the rest; the run's is their sum.
    rows = {s["stage"]: s for s in demo_run.summary["stages"]}
    for name in ("boost_and_shard", "train_cpt", "reboost", "train_sft"):  # the stages that launch ranks
        row = rows[name]
        assert row["cpu_children_seconds"] > 1.0 and row["cpu_seconds"] >= row["cpu_children_seconds"], row
    for name in ("unshard", "evaluate_cpt", "export"):  # work of the flow process itself
        row = rows[name]
        assert row["cpu_seconds"] - row["cpu_children_seconds"] > 0.05, row
    assert demo_run.summary["cpu_seconds"] == pytest.approx(sum(s["cpu_seconds"] or 0 for s in rows.values()), abs=0.1)
    assert re.search(r"train_cpt\s+completed\s+\S+\s+\d\S*s\s+loss", text)
