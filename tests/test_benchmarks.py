"""Every benchmark's `--smoke` mode runs as a real subprocess, exits 0 and prints its table, so a
benchmark breaks in the test run that broke it instead of the next time someone needs its figures:

    .venv/bin/python -m pytest -q -m "" tests/test_benchmarks.py

A smoke run takes the script's own code path at tiny sizes; its figures mean nothing and are not
judged, only that the table and its ratio lines come out. Smoke runs that launch torchrun are
`distributed`; those that run Prefect flows or real servers (SeaweedFS) are `integration`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from support.servers.slurm import slurm_available

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
# Hang guards, not speed checks: a smoke run takes seconds to a few minutes on two idle cores, and
# several times that beside the suite's other workers (one took over 300 s there, correct but slow).
# A hung one is stopped, its process group with it, an order of magnitude past the slowest correct run.
SMOKE_TIMEOUT = 1800  # the smoke runs of minutes: flows, torchrun launches
E2E_TIMEOUT = 2700  # gpu_check.sh's dry run and resume.py: whole flows, killed and retried
# pytest-timeout's limit for these tests (pyproject: 900 s) sits above the guards, which say more
pytestmark = pytest.mark.timeout(E2E_TIMEOUT + 300)


def smoke(argv: list[str], timeout: float = SMOKE_TIMEOUT, env: dict[str, str] | None = None) -> str:
    """Run one benchmark command from the repository root; its combined output, after asserting rc 0.
    Past `timeout` its whole process group (torchrun's ranks, servers) is killed and the test fails."""
    full_env = {
        **os.environ,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "TOKENIZERS_PARALLELISM": "false",
        **(env or {}),
    }
    with subprocess.Popen(
        argv,
        cwd=REPO,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    ) as p:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, _ = p.communicate()
            pytest.fail(f"{' '.join(argv)} still ran after {timeout:.0f} s (a hang guard):\n{out[-4000:]}")
    assert p.returncode == 0, f"{' '.join(argv)} exited {p.returncode}:\n{out[-4000:]}"
    return out


def session_api() -> dict[str, str]:
    """PREFECT_API_URL of the session's Prefect server (the `prefect_harness` fixture), for a benchmark whose
    flows would otherwise start an embedded server of their own: ~13 CPU-s a start and life on 2 busy cores,
    which the smoke does not judge (tests/test_embedded_api.py and test_signals.py test that server)."""
    from prefect.settings import PREFECT_API_URL

    return {"PREFECT_API_URL": PREFECT_API_URL.value()}


def test_convert_smoke():
    out = smoke([PY, "benchmarks/convert.py", "--smoke"])
    for label in ("c copy", "a ours", "b naive", "b naive+sha256"):
        assert f"  {label} " in out, out
    assert "ours/copy throughput" in out and "naive/ours time" in out and "ours RSS growth" in out, out
    assert '"a_over_c_throughput"' in out, out


def test_preflight_time_smoke():
    out = smoke(["bash", "benchmarks/preflight_time.sh", "--smoke"], env={"PY": PY})
    assert "failing  rc=1 (expected 1)" in out, out
    assert "given    rc=" in out and "median wall" in out, out
    # the failing config must fail as a pre-flight report, not as a crash of the check itself
    assert "Traceback" not in out, out


def test_gpu_wheels_smoke():
    had_dest = (REPO / ".whl").exists()
    out = smoke(["bash", "benchmarks/gpu_wheels.sh", "--smoke"], env={"PYTHON": PY})
    assert "pinned wheels" in out and "nothing fetched" in out, out
    assert (REPO / ".whl").exists() == had_dest, "the smoke run must not create .whl/"


@pytest.mark.integration
def test_storage_smoke():
    out = smoke([PY, "benchmarks/storage.py", "--smoke"])
    for row in ("ours: RunStore.publish", "sequential s3fs put_file", "local disk copy (copytree)"):
        assert row in out, out
    assert "ours / sequential put = " in out and "CPU s per GB" in out, out


def test_benchmark_preflight_smoke():
    """Pre-flight's benchmark check on a task of 1,000 documents (lm-eval imported once, then timed): the
    script runs and the task passes; the full run adds 10^5, 10^6 and a 1 GB file (docs/benchmarks.md)."""
    out = smoke([PY, "benchmarks/benchmark_preflight.py", "--docs", "1000", "--smoke"])
    line = next(ln for ln in out.splitlines() if "documents" in ln)
    assert line.split()[0] == "1,000" and line.rstrip().endswith("passed"), out


def test_rank_start_smoke():
    """The bare launch through the agent alone, one rank (~5 CPU-s: torchrun's agent and a rank importing torch and
    colossalai): launched with each rank's import tree in a file, rank 0's read back into the table."""
    out = smoke([PY, "benchmarks/rank_start.py", "--smoke"])
    row = next(ln.split("|") for ln in out.splitlines() if ln.strip().startswith("bare |"))
    assert float(row[1]) > 0 and float(row[4]) > 0 and int(row[5]) > 1000, out  # wall, imports, modules
    assert "command: python benchmarks/rank_start.py --smoke" in out, out


def test_reshard_smoke():
    """The tiny checkpoint saved by DCP's two writers, then restored to tp2dp2 by the engine's reads
    (tasks/engine/state_read.py, masters.restore), the path before them, DCP's default reader and its
    safetensors reader, in memory and from evicted files; the engine's state bitwise `local_piece`'s and
    DCP's readers agreeing (6 processes: 2 source ranks, 4 target ranks)."""
    out = smoke([PY, "benchmarks/reshard.py", "--smoke"])
    row = next(ln.split() for ln in out.splitlines() if ln.startswith("tiny "))
    assert len(row) == 19 and all(float(x) > 0 for x in row[3:11]), out  # every side's seconds, warm and cold
    assert row[1] == "tp2dp2" and row[-1] == "yes", out  # the padded vocabulary's tp pieces, bitwise
    assert "command: python benchmarks/reshard.py --smoke" in out, out


@pytest.mark.distributed
def test_shardformer_policies_smoke():
    """Each policy row's claims (trains at tp=2 and at pp=2, or refused with its failure) are measured on 2 gloo
    ranks, in one launch, with what its row has the engine pass (attention implementation, shardformer flags);
    in the same launch, each plan row's family and Llama under the derived tensor-parallel policy against the
    unsharded model, and SmolLM3 and OLMo 3 saved and resumed at tp=2 bitwise (benchmarks/plan_policies.py, which
    shardformer_policies.py runs for --plan and within --smoke)."""
    out = smoke(
        [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "benchmarks/shardformer_policies.py", "--smoke"],
        env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    results = {
        r["family"]: r
        for r in (json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if line.startswith("@@policy "))
    }
    rows = {"bloom", "cohere", "falcon", "gpt2", "gptj", "mixtral", "opt"}  # each at tp=2, and at pp=2 (claimed)
    assert {f for f, r in results.items() if r["works"]} == rows | {f"{r}@pp2" for r in rows}, out
    assert results["opt"]["settings"] == {"attn_implementation": "eager"}, out  # what the engine builds OPT with
    assert results["gpt2"]["settings"] == {"enable_flash_attention": True}, out
    assert all(results[r]["replica_diff"] == 0.0 and results[r]["fingerprint_diff"] <= 1e-4 for r in rows), out
    # the derived tensor-parallel policy, same launch: every plan row at tp=2 like the unsharded model (two steps'
    # losses, every gradient, the converted weights), a tied head and GQA among them; each dropped handling caught
    plan = {
        r["family"]: r
        for r in (json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if line.startswith("@@plan "))
    }
    from tasks.core.models.tp_plan import PLAN_ROWS, too_old

    # Llama beside them: the derived policy like the unsharded model where ColossalAI's policy runs it
    built = {f for f in PLAN_ROWS if not too_old(f)} | {"llama"}  # SmolLM3, OLMo 3: transformers >= 4.53, 4.57
    variants = {f for f, r in plan.items() if "variant" in r}  # one works where its transformers ships the fix
    assert {f for f, r in plan.items() if r["works"]} - variants == built, out
    assert all(plan[v]["works"] != plan[v]["variant_applies"] for v in variants), out
    assert all(plan[f]["grad_rel"] <= 1e-4 and plan[f]["weight_rel"] <= 1e-4 for f in built), out
    # saved at tp=2 and resumed (a lazily built model, the checkpoint read as the engine reads it, AdamW's state): the
    # step after the save again, bitwise, for SmolLM3 (tied head, GQA) and OLMo 3 (split weights, whole attention)
    resumed = {f for f in built if "resume_bitwise" in plan[f]}
    assert resumed == {"smollm3", "olmo3"} & built, out
    assert all(plan[f]["resume_bitwise"] and len(set(plan[f]["resume_loss"])) == 1 for f in resumed), out
    assert all("needs transformers >=" in plan[f]["skipped"] for f in set(PLAN_ROWS) - built), out
    assert plan["gemma3_text"]["tied"] and plan["phi3"]["split_params"] > 0, out
    assert plan["qwen3-norm_grad_sum"]["grad_rel"] > 0.1, out  # the q/k norms' gradients, unsummed
    if plan["starcoder2-plan_fix"]["variant_applies"]:  # its plan as transformers 4.51.3 ships it (4.57 fixed it)
        assert "AssertionError" in plan["starcoder2-plan_fix"]["failure"], out


@pytest.mark.distributed
def test_plain_colossalai_train_smoke():
    out = smoke(
        [
            PY,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "1",
            "benchmarks/plain_colossalai_train.py",
            "--smoke",
        ],
        env={"OMP_NUM_THREADS": "1"},
    )
    assert out.count("@@progress ") == 3, out
    assert "plain: done, 384 tokens" in out, out


@pytest.mark.distributed
def test_activation_checkpointing_smoke():
    """Both modes in one launch on the demo's tiny model (~15 s): the table, the per-rank lines and the comparison."""
    out = smoke([PY, "benchmarks/activation_checkpointing.py", "--smoke"])
    assert "rank | mode | peak RSS MiB | growth in training MiB | step s" in out, out
    assert "rank 0: growth " in out and "rank 1: growth " in out, out
    assert (
        "final weights bitwise equal" in out and "command: python benchmarks/activation_checkpointing.py --smoke" in out
    ), out


@pytest.mark.distributed
def test_long_context_smoke():
    """Every CPU layout in one launch on the demo's tiny model: the table, each layout's row and trials, the command."""
    out = smoke([PY, "benchmarks/long_context.py", "--smoke"])
    assert "longest seq_len | vs dp2" in out, out
    for layout in ("dp2", "tp2", "split_gather", "all_to_all"):
        assert f"  {layout}: 256: " in out, out
    assert "command: python benchmarks/long_context.py --smoke" in out, out


@pytest.mark.distributed
def test_data_smoke():
    out = smoke([PY, "benchmarks/data.py", "--smoke"])
    assert "prep 1w MB/s | prep 2w MB/s | 2w/1w (>=1.6)" in out and "resume/start (<=1.1)" in out, out
    assert "launch -> first step s | whole run s | peak RSS per rank MB | last loss" in out, out
    assert "One JSONL file of" in out and "2w/1w (>=1.7)" in out and "worker on a chunk/tok (>=0.8)" in out, out
    assert "command: python benchmarks/data.py --smoke" in out, out


@pytest.mark.e2e
def test_gpu_check_smoke(tmp_path, prefect_harness):
    """gpu_check.sh's set-up on this CPU machine, then gpu_check.py --smoke: the dry run (the flow killed
    once and resumed, beside the plain baseline) at 4 steps a stage, every check but gpu_tests reported.
    Its two flow runs use the session's Prefect server (GPU_CHECK_PREFECT_API_URL), not an embedded one each."""
    out = smoke(
        ["bash", "benchmarks/gpu_check.sh", "--smoke", "--work", str(tmp_path / "work")],
        timeout=E2E_TIMEOUT,
        env={
            "PYTHON": PY,
            "GPU_CHECK_SITE": str(tmp_path / "site"),
            "GPU_CHECK_WHEELS": str(tmp_path / "no-wheels"),
            "OUT": str(tmp_path / "out"),
            "GPU_CHECK_PREFECT_API_URL": session_api()["PREFECT_API_URL"],
        },
    )
    for check in (
        "env",
        "model",
        "preflight",
        "plain_baseline",
        "flow_kill",
        "flow_resume",
        "sft_checkpoint",
        "export_fingerprint",
        "throughput",
        "same_kernels",
    ):
        assert f"CHECK {check}: ok" in out, out
    assert "CPT throughput, steps" in out and "flow / plain = " in out, out
    assert "RESULT: all checks ok" in out and (tmp_path / "out" / "summary.json").is_file(), out


@pytest.mark.e2e
def test_resume_smoke(prefect_harness):
    """The flow up to train_cpt on the session's Prefect server (the script starts its embedded one only
    without PREFECT_API_URL: ~13 CPU-s saved): a run killed inside a CPT checkpoint interval, its retry,
    then its re-run once complete."""
    out = smoke([PY, "benchmarks/resume.py", "--smoke"], timeout=E2E_TIMEOUT, env=session_api())
    for row in (
        "first run wall",
        "re-run of complete run",
        "re-run / first",
        "killed after CPT step",
        "resumed from step",
        "steps redone",
    ):
        assert row in out, out
    assert "result: " in out, out


@pytest.mark.e2e
def test_preemption_smoke(prefect_harness):
    """The flow up to train_cpt, uninterrupted, then its copy from step 0 preempted once by a SIGTERM
    notice and retried by the flow itself: the per-preemption table and the wall-time ratio come out.
    On the session's Prefect server, as test_resume_smoke."""
    out = smoke([PY, "benchmarks/preemption.py", "--smoke"], timeout=E2E_TIMEOUT, env=session_api())
    for row in ("| # | noticed after step |", "stage wall, uninterrupted", "preempted / uninterrupted", "bitwise"):
        assert row in out, out
    # run.json's record carries every mark of the recovery: the engine's, the stage's, the flow's, the new ranks'
    (row,) = [line for line in out.splitlines() if line.startswith("| 1 | 1 rank |")]
    assert "n/a" not in row and row.count("%)") == 9, row
    assert "result: ok" in out, out[-4000:]  # one rank, 6 steps: steps lost 0, bitwise, within the grace


@pytest.mark.integration
@pytest.mark.distributed
def test_publish_smoke():
    out = smoke([PY, "benchmarks/publish.py", "--smoke"])
    for mode in ("local", "sync", "async"):
        assert f"  {mode:<6} " in out and "steps/s" in out, out
    assert "(a) local   (b) S3 sync   (c) S3 async" in out and "ratio to (a)" in out, out
    assert "FAILED" not in out and "failed:" not in out, out


@pytest.mark.distributed
def test_launch_smoke():
    """The local backend always; the Slurm backend where the Slurm tests would run (installed, root)."""
    out = smoke([PY, "benchmarks/launch.py", "--smoke"])
    assert "round 1 local: task start -> first step" in out, out
    assert "task start -> step 1 best" in out and "task start -> step 1 median" in out, out
    if slurm_available() and os.geteuid() == 0:
        assert (
            "round 1 slurm: task start -> first step" in out and "Slurm adds " in out and "not measured" not in out
        ), out
    else:
        assert "slurm: skipped" in out and "Slurm adds: not measured" in out, out


def test_sft_efficiency_smoke():
    out = smoke([PY, "benchmarks/sft_efficiency.py", "--smoke"])
    assert "useful tokens" in out and "loss equivalence" in out, out[-3000:]
    rows = {
        ln.split()[0]: ln.split()
        for ln in out.splitlines()
        if ln.split() and ln.split()[0] in ("grouped", "padded", "packed")
    }
    assert float(rows["grouped"][1]) > float(rows["padded"][1]), out[
        -3000:
    ]  # grouping computes less padding, whatever the sizes
    assert float(rows["packed"][1]) >= float(rows["grouped"][1]), out[-3000:]
    assert "equal per-token losses: met" in out, out[-3000:]  # exactness holds at any size


def test_dpo_step_smoke():
    """One process, 4 pairs, 3 rounds (~9 CPU-s, most of it imports and the tiny model's tokenizer): the
    table, finite positive ratios, and a first DPO loss of log 2, the policy starting as the reference."""
    import math

    out = smoke([PY, "benchmarks/dpo_step.py", "--smoke"])
    assert "side | real tokens | step ms | tokens/s | x sft | first loss" in out, out[-3000:]
    assert "command: python benchmarks/dpo_step.py --smoke" in out, out[-3000:]
    (line,) = [ln for ln in out.splitlines() if ln.startswith("@@dpo_step ")]
    r = json.loads(line.split(" ", 1)[1])
    for ratio in (r["dpo_over_sft"], r["dpo_ref_over_sft"]):
        assert math.isfinite(ratio) and ratio > 0, r
    assert r["first_loss"]["dpo"] == pytest.approx(math.log(2), abs=1e-5), r
    assert r["first_loss"]["dpo+ref"] == pytest.approx(math.log(2), abs=1e-5), r
    assert r["reference_gap"] < 1e-4, r  # the reference pass on the batch gives the artifact's figures


def test_mixture_smoke():
    out = smoke([PY, "benchmarks/mixture.py", "--smoke"])
    rows = {
        ln.split()[0]: ln.split() for ln in out.splitlines() if ln.split() and ln.split()[0] in ("big", "mid", "small")
    }
    assert set(rows) == {"big", "mid", "small"}, out[-3000:]
    assert all(float(r[3]) <= 0.01 for r in rows.values()), out[-3000:]  # the blend's shares hold at any size
    assert (
        "prepare (s)" in out and "per-step data (ms)" in out and "command: python benchmarks/mixture.py --smoke" in out
    ), out[-3000:]


def test_flow_process_smoke():
    out = smoke([PY, "benchmarks/flow_process.py", "--smoke"])
    row = next(ln.split(" | ") for ln in out.splitlines() if ln.startswith("tiny | "))
    assert row[12] == "yes", out[-3000:]  # streamed logits bitwise the whole model's, at any size
    assert "skip decision by stamp:" in out and "command: python benchmarks/flow_process.py --smoke" in out, out[-3000:]


def test_skip_smoke():
    """The skip decision at 1, 4 and 16 MB (~2 s): hashing vs the verification stamp, each row and the ratio line."""
    out = smoke([PY, "benchmarks/skip.py", "--smoke"])
    rows = [ln.split() for ln in out.splitlines() if ln.strip().endswith("x") and "MB" in ln]
    assert [r[0] for r in rows] == ["1MB", "4MB", "16MB"] and all(float(r[3]) > 0 for r in rows), out
    assert "stamp time, largest / smallest artifact: " in out and "command: python benchmarks/skip.py --smoke" in out


@pytest.mark.distributed
def test_lora_smoke():
    """Full fine-tuning and LoRA on the demo's tiny model, one rank, 2 steps each (4 launches, ~30 CPU-s):
    the JSON result with both modes' figures and the LoRA merge's proof."""
    import json

    out = smoke([PY, "benchmarks/lora.py", "--smoke"])
    result, _ = json.JSONDecoder().raw_decode(out, out.rindex('{\n  "full": {'))  # the printed result
    assert set(result) >= {"full", "lora", "checkpoint_share", "peak_saving_bytes", "frozen_optimizer_bytes_per_rank"}
    assert result["lora"]["checkpoint_bytes"] < result["full"]["checkpoint_bytes"], result  # the adapter only
    assert result["lora"]["merged_export_s"] > 0 and result["lora"]["export_rel_diff"] is not None, result


@pytest.mark.distributed
def test_scale_smoke():
    """The ~0.1M model under hybrid_parallel tp=2, 2 steps (two 2-rank launches, ~30 CPU-s); the flow
    process's figures left out (test_flow_process_smoke runs them): the table and its verdict lines."""
    out = smoke([PY, "benchmarks/scale.py", "--smoke", "--no-flow"])
    row = next(ln.split(" | ") for ln in out.splitlines() if ln.startswith("tiny | "))
    assert row[2] == "hp-tp2-fp32" and float(row[-1]) > 0, out[-3000:]  # estimate / steady RSS
    assert "largest |estimate/steady - 1|" in out and "shard peak over its limit" in out, out[-3000:]


def test_every_benchmark_has_a_smoke_test():
    """Each script under benchmarks/ (the bootstrap aside) is run here, so none can rot unseen."""
    here = Path(__file__).read_text()
    scripts = [p for p in (REPO / "benchmarks").iterdir() if p.suffix in (".py", ".sh") and p.name != "_checkout.py"]
    missing = [p.name for p in scripts if f"benchmarks/{p.stem}." not in here]
    assert not missing, f"benchmarks without a smoke test in tests/test_benchmarks.py: {missing}"
