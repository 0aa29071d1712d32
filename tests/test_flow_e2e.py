"""The whole flow on the tiny config, in-process on an ephemeral Prefect server (e2e tier).

One module-scoped scenario serves every test here, because a flow run costs minutes on 2 cores:
  1. a run whose SFT stage dies (rank 1 SIGKILLed after step 5; the step-4 checkpoint is complete);
  2. the retry over the same run root: the first five stages are skipped without a launch, SFT
     resumes from step 4 and the run completes;
  3. a re-run of the complete run: every stage skipped, no torchrun process at all;
  4. the same run root with an impossible gate threshold: only the gate is decided anew, it fails,
     the push is skipped and the flow run ends Completed, named "FailedGate";
  5. the same with `gate.enabled: false`: the push runs again, the run is complete.
"""

from __future__ import annotations

import json

import pytest
import torch

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
    """Wraps tasks.train.run_engine: records every engine launch and the steps it trained."""

    def __init__(self, real):
        self.real, self.calls = real, []

    def __call__(self, verb, job, *args, **kwargs):
        progress = self.real(verb, job, *args, **kwargs)
        self.calls.append({"verb": verb, "stage": job.stage, "steps": [int(p["step"]) for p in progress]})
        return progress


@pytest.fixture(scope="module")
def scenario(prefect_harness, tiny_model_dir, tmp_path_factory):
    import tasks.train
    from flows.cpt_to_sft import main

    tmp = tmp_path_factory.mktemp("e2e")
    run_root = tmp / "run"
    cfg = write_config(tmp / "tiny.yaml", tiny_config_raw(tiny_model_dir, run_root))
    mp = pytest.MonkeyPatch()
    runs = []
    try:
        for fault in ("kill@step=5@stage=sft", "", ""):
            launches = Launches(tasks.train.run_engine.__wrapped__ if hasattr(tasks.train.run_engine, "__wrapped__") else tasks.train.run_engine)
            mp.setattr(tasks.train, "run_engine", launches)
            mp.setenv("CPT_TO_SFT_FAULT", fault) if fault else mp.delenv("CPT_TO_SFT_FAULT", raising=False)
            try:
                rc = main(["--config", str(cfg)])
            except Exception as exc:  # the failed run raises the task's error
                rc = exc
            summary = json.loads((run_root / "run.json").read_text())
            runs.append({"rc": rc, "launches": launches.calls, "summary": summary})
            mp.setattr(tasks.train, "run_engine", launches.real)
        runs += _gate_reruns(mp, tmp, tiny_model_dir, run_root)
    finally:
        mp.undo()
    return run_root, runs


def _gate_reruns(mp, tmp, model_dir, run_root):
    """Steps 4 and 5: only the gate config changes; gate config is in no artifact's digest."""
    import flows.cpt_to_sft as flow_mod
    import tasks.train

    out = []
    for name, gate in (("failing", {"cpt_max_ppl_increase_pct": -100.0}), ("disabled", {"cpt_max_ppl_increase_pct": -100.0, "enabled": False})):
        raw = tiny_config_raw(model_dir, run_root)
        raw["gate"].update(gate)
        cfg = write_config(tmp / f"tiny-gate-{name}.yaml", raw)
        launches, pushes = Launches(tasks.train.run_engine), []
        real_push = flow_mod.push_to_hub
        mp.setattr(tasks.train, "run_engine", launches)
        mp.setattr(flow_mod, "push_to_hub", lambda cfg_, results, _real=real_push, pushes=pushes: (pushes.append(cfg_.gate.enabled), _real(cfg_, results))[1])
        if name == "failing":
            state = flow_mod.cpt_to_sft(config=str(cfg), return_state=True)
            out.append({"state": state, "rc": None, "launches": launches.calls, "pushes": pushes, "summary": json.loads((run_root / "run.json").read_text())})
        else:
            rc = flow_mod.main(["--config", str(cfg)])
            out.append({"rc": rc, "launches": launches.calls, "pushes": pushes, "summary": json.loads((run_root / "run.json").read_text())})
        mp.setattr(tasks.train, "run_engine", launches.real)
        mp.setattr(flow_mod, "push_to_hub", real_push)
    return out


@pytest.fixture(scope="module")
def finished_run(scenario):
    run_root = scenario[0]
    return run_root, run_root.parent / "tiny.yaml"  # the scenario's config file


def statuses(summary):
    return {s["stage"]: s["status"] for s in summary["stages"]}


def test_failed_sft_run_is_recorded(scenario):
    _, runs = scenario
    first = runs[0]
    assert isinstance(first["rc"], Exception) and "exited with status" in str(first["rc"])
    assert first["summary"]["complete"] is False
    st = statuses(first["summary"])
    assert st["train_cpt"] == "completed" and st["train_sft"] == "failed" and st["export"] == "not-run"


def test_retry_skips_done_stages_and_resumes_sft(scenario):
    _, runs = scenario
    retry = runs[1]
    assert retry["rc"] == 0 and retry["summary"]["complete"] is True
    st = statuses(retry["summary"])
    for stage in ("load_from_hf", "prepare_cpt", "prepare_sft", "boost_and_shard", "train_cpt", "unshard", "evaluate_cpt", "reboost"):
        assert st[stage] == "skipped", (stage, st)
    assert st["train_sft"] == "completed" and st["export"] == "completed" and st["evaluate_sft"] == "completed"
    assert st["gate"] == "passed" and retry["summary"]["gate"]["passed"] is True
    # Only SFT training was launched, and it continued after the step-4 checkpoint.
    assert [(c["verb"], c["stage"]) for c in retry["launches"]] == [("train", "sft")]
    assert retry["launches"][0]["steps"] == [5, 6, 7, 8]


def test_rerun_of_complete_run_launches_nothing(scenario):
    _, runs = scenario
    rerun = runs[2]
    assert rerun["rc"] == 0 and rerun["launches"] == []
    st = statuses(rerun["summary"])
    assert st.pop("gate") == "passed"  # a decision over recorded metrics, taken on every run
    assert set(st.values()) <= {"skipped", "not-configured"}, st


def test_every_stage_has_a_verified_artifact(finished_run):
    from tasks.core.manifest import manifest_digest, verify_artifact

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

    from tasks.core.convert import load_state_dict_from_dir

    run_root, _ = finished_run
    cpt = json.loads((run_root / "cpt/step-000008/train_state.json").read_text())["losses"]
    assert len(cpt) == 8 and cpt[-1] < cpt[0]
    # The reboost stage loaded exactly the unsharded CPT weights (cast to plugin B's bf16).
    bridge = load_state_dict_from_dir(run_root / "cpt/hf")
    sft0 = load_state_dict_from_dir(run_root / "sft/step-000000/model")
    assert set(sft0) == set(bridge)
    for key, tensor in bridge.items():
        assert torch.equal(sft0[key].float(), tensor.to(sft0[key].dtype).float()), key
    manifest = json.loads((run_root / "sft/step-000000/manifest.json").read_text())
    assert manifest["parent"]["uri"].endswith("cpt/hf")


def test_export_loads_in_transformers_with_matching_logits(finished_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tasks.core.fingerprint import load_fingerprint, model_logits

    run_root, _ = finished_run
    export = run_root / "export"
    names = {p.name for p in export.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    assert any(n.endswith(".safetensors") and n != "fingerprint.safetensors" for n in names)
    model = AutoModelForCausalLM.from_pretrained(export, torch_dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(export)
    assert tok.chat_template and "assistant" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    logits = model_logits(model, model.config.vocab_size)
    reference = load_fingerprint(run_root / "sft/step-000008")
    diff = float((logits - reference).abs().max())
    verification = json.loads((export / "verification.json").read_text())
    assert verification["fingerprint_match"] and diff <= verification["fingerprint_atol"], diff
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_bridge_is_bitwise_the_plugin_a_checkpoint_and_reproduces_its_logits(finished_run):
    from tasks.core.convert import load_state_dict_from_dir

    run_root, _ = finished_run
    saved = load_state_dict_from_dir(run_root / "cpt/step-000008/model")
    bridge = load_state_dict_from_dir(run_root / "cpt/hf")
    assert set(saved) == set(bridge)
    for key in saved:
        assert saved[key].dtype == bridge[key].dtype and torch.equal(saved[key], bridge[key]), key
    # The unshard stage compared plain transformers' logits with the live plugin-A (tp=2) logits.
    meta = json.loads((run_root / "cpt/hf/manifest.json").read_text())["meta"]["verification"]
    assert meta["fingerprint_max_abs_diff"] <= 1e-5 and meta["fingerprint_match"] is True


def test_evaluation_is_recorded_in_manifests_and_run_json(scenario):
    from tasks.core.data import read_records
    from tasks.core.paths import resolve_local
    from tasks.core.split import record_id
    from tasks.core.stage_data import heldout_records

    run_root, runs = scenario
    summary = runs[1]["summary"]  # the run that completed SFT, evaluation and the gate
    cpt = json.loads((run_root / "eval/cpt/manifest.json").read_text())["meta"]["metrics"]
    sft_manifest = json.loads((run_root / "eval/sft/manifest.json").read_text())
    sft = sft_manifest["meta"]["metrics"]
    assert summary["evaluation"] == {"cpt": cpt, "sft": sft}
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
        split = json.loads((run_root / artifact / "manifest.json").read_text())["meta"]["data_split"]
        assert split == metrics["split"] and split["method"] == "hash-fraction" and split["heldout_records"] >= 1
        # prepare_data decided the split in its one pass; the held-out records live in data/<stage>/.
        held = heldout_records(run_root / "data" / stage)
        held_ids = {record_id(r) for r in held}
        train = [r for r in read_records(resolve_local(split["data_uri"])) if record_id(r) not in held_ids]
        assert len(train) == split["train_records"] + split["dropped_no_labels"] and len(held) == split["heldout_records"]
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


def test_second_run_over_a_held_run_root_fails_naming_the_holder(finished_run):
    from flows.cpt_to_sft import main
    from tasks.core.lease import Lease, LeaseHeld
    from tasks.core.storage import RunStore

    run_root, cfg = finished_run
    holder = Lease(RunStore(str(run_root)), holder="flow run other-writer (test)").acquire()
    try:
        with pytest.raises(LeaseHeld, match="other-writer"):
            main(["--config", str(cfg)])
    finally:
        holder.release()
