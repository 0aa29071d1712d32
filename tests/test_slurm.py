"""The Slurm launch backend's core (`tasks/core/launch/slurm.py`, `tasks/core/launch/slurm_batch.py`): batch-script rendering and failure
messages (unit tier), and on a real two-node Slurm cluster (integration tier, the
`slurm_cluster` fixture: slurmctld + slurmd n1 and n2 on 127.0.0.1) a torchrun c10d rendezvous
across both nodes, the states of a failing and a cancelled job, and the pre-flight refusals.

    python -m pytest -m "" tests/test_slurm.py
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tasks.core.config.load import parse_config
from tasks.core.config.schema import LaunchConfig
from tasks.core.config.slurm import SlurmConfig
from tasks.core.errors import ConfigError
from tasks.core.launch.slurm import JobInfo, SlurmCli, parse_kv, preflight
from tasks.core.launch.slurm_batch import NodeLogs, engine_program, failure_message, render_batch_script, wait_for_job
from tests.conftest import REPO, tiny_config_raw

pytest_plugins = ["tests.conftest_slurm"]

PROBE = str(REPO / "tests" / "_slurm_probe.py")


def _launch(**slurm) -> LaunchConfig:
    return LaunchConfig(backend="slurm", nnodes=2, nproc_per_node=1, slurm=SlurmConfig(**slurm) if slurm else None)


# -- unit tier: rendering, parsing, config rules --------------------------------------------


def test_render_batch_script_has_one_agent_per_node_and_every_setting(tmp_path):
    launch = LaunchConfig(
        backend="slurm",
        nnodes=4,
        nproc_per_node=8,
        slurm=SlurmConfig(
            partition="gpu",
            time_limit="2-00:00:00",
            gpus_per_node=8,
            account="llm",
            extra_sbatch_args=("--qos=high", "--exclusive"),
        ),
    )
    script = render_batch_script(
        engine_program("train", "/runs/x/cpt/train.json"),
        launch,
        "x-cpt-train",
        tmp_path / "logs",
        "/repo",
        python="/venv/bin/python",
    )
    directives = [ln.removeprefix("#SBATCH ") for ln in script.splitlines() if ln.startswith("#SBATCH")]
    assert directives == [
        "--job-name=x-cpt-train",
        "--nodes=4",
        "--ntasks-per-node=1",
        f"--output={tmp_path / 'logs'}/job-%j.batch.log",
        "--chdir=/repo",
        "--no-requeue",
        "--partition=gpu",
        "--time=2-00:00:00",
        "--gpus-per-node=8",
        "--account=llm",
        "--qos=high",
        "--exclusive",
    ]
    srun = script[script.index("srun ") :]
    for part in (
        '--nodes="$SLURM_NNODES"',
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        (
            "/venv/bin/python -m torch.distributed.run --nnodes=$SLURM_NNODES --nproc-per-node=8 --rdzv-backend=c10d "
            '--rdzv-endpoint="$head_addr:$port" --rdzv-id=$SLURM_JOB_ID'
        ),
        "-m tasks.engine train --config /runs/x/cpt/train.json",
        f'{tmp_path / "logs"}/job-"$SLURM_JOB_ID"',
    ):
        assert part in srun, part
    # bash itself accepts the script (a quoting slip would surface here, not on a cluster).
    path = tmp_path / "job.sh"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True)


def test_render_quotes_paths_with_spaces(tmp_path):
    script = render_batch_script(
        [PROBE, "a b"], LaunchConfig(backend="slurm"), "j", tmp_path / "my logs", "/r", python="/p y/python"
    )
    assert "'/p y/python' -m torch.distributed.run" in script
    assert "'a b'" in script
    assert f"'{tmp_path}/my logs/job-'\"$SLURM_JOB_ID\"" in script
    assert "#SBATCH --partition" not in script and "#SBATCH --gpus-per-node" not in script


def test_parse_kv_keeps_values_with_spaces():
    kv = parse_kv(
        "JobId=7 JobName=a JobState=FAILED Reason=NonZeroExitCode Dependency=(null) ExitCode=1:0 "
        "Command=/x/job.sh arg StdOut=/x/o.log NodeList=n[1-2] BatchHost=n1"
    )
    assert kv["JobState"] == "FAILED" and kv["ExitCode"] == "1:0" and kv["NodeList"] == "n[1-2]"
    assert kv["Command"] == "/x/job.sh arg" and kv["BatchHost"] == "n1"


def test_failure_message_names_state_node_and_rank():
    info = JobInfo(job_id="12", state="FAILED", exit_code="1:0", nodes="n[1-2]", reason="NonZeroExitCode")
    batch = ["srun: error: n2: task 1: Exited with exit code 1", "srun: error: n1: task 0: Terminated"]
    nodes = {
        "n1": ["[rank 0] step 3"],
        "n2": [
            "[rank 1] Traceback (most recent call last):",
            "[rank 1] RuntimeError: boom",
            "Root Cause (first observed failure):",
            "[0]:",
            "  time      : 2026-11-30_10:00:00",
            "  rank      : 1 (local_rank: 0)",
            "  exitcode  : 1 (pid: 99)",
        ],
    }
    msg = failure_message(info, batch, nodes, what="cpt train")
    first = msg.splitlines()[0]
    assert first.startswith(
        "Slurm job 12 (cpt train) ended FAILED (exit code 1) on node n2, rank 1: Exited with exit code 1"
    )
    assert "n1:" not in first  # the node srun terminated is a casualty, not the failure
    assert "--- node n2 ---" in msg and "RuntimeError: boom" in msg


def _torchrun_summary(rank: int, exitcode: int, at: str, micros: str) -> list[str]:
    """The end of a node's log as torchrun writes it when a rank fails (read from a real two-node run)."""
    sig = {-9: " (SIGKILL)", -15: " (SIGTERM)"}.get(exitcode, "")
    return [
        (
            f"E1202 {at}.{micros} 24373 .venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] "
            f"failed (exitcode: {exitcode}) local_rank: 0 (pid: 24415) of binary: /work/main/.venv/bin/python"
        ),
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "tasks.engine FAILED",
        "Failures:",
        "  <NO_OTHER_FAILURES>",
        "Root Cause (first observed failure):",
        "[0]:",
        f"  time      : 2026-12-02_{at}",
        "  host      : localhost",
        f"  rank      : {rank} (local_rank: 0)",
        f"  exitcode  : {exitcode} (pid: 24415) {sig}",
        "  error_file: <N/A>",
        "  traceback : "
        + (
            f"Signal {-exitcode}{sig} received by PID 24415"
            if exitcode < 0
            else "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
        ),
    ]


_GLOO_RESET = (
    "[rank 0|error] RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
    "[127.0.0.1]:39052: Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the "
    "application."
)


@pytest.mark.parametrize("srun_first", ["n1", "n2"])
def test_failure_message_leads_with_the_killed_rank_not_its_peer(srun_first):
    """Rank 1 (on n2) SIGKILLed; rank 0 (on n1) then fails on gloo's connection reset, and on a
    loaded machine its agent may exit, and srun report it, first: n2 still leads."""
    info = JobInfo(job_id="7", state="FAILED", exit_code="1:0", nodes="n[1-2]", reason="NonZeroExitCode")
    nodes = {
        "n1": ["[rank 0] step 2", _GLOO_RESET, *_torchrun_summary(0, 1, "07:32:20", "491000")],
        "n2": [
            "[rank 1|error] injected fault 'kill@step=2@rank=1' (CPT_TO_SFT_FAULT)",
            *_torchrun_summary(1, -9, "07:32:20", "295000"),
        ],
    }
    task = {"n1": 0, "n2": 1}
    second = "n2" if srun_first == "n1" else "n1"
    batch = [f"srun: error: {n}: task {task[n]}: Exited with exit code 1" for n in (srun_first, second)]
    first = failure_message(info, batch, nodes, what="engine verb 'train'").splitlines()[0]
    assert first.startswith(
        "Slurm job 7 (engine verb 'train') ended FAILED (exit code 1) on node n2, rank 1: Exited with exit code 1; "
        "node n1, rank 0: Exited with exit code 1."
    ), first
    msg = failure_message(info, batch, nodes)
    assert msg.index("--- node n2 ---") < msg.index("--- node n1 ---")
    if srun_first == "n1":
        # n1's agent exited first and srun terminated n2 before its agent could: the
        # node whose log shows the SIGKILL still leads, and srun's word for it is not the story.
        batch = ["srun: error: n1: task 0: Exited with exit code 1", "srun: error: n2: task 1: Terminated"]
        first = failure_message(info, batch, nodes, what="engine verb 'train'").splitlines()[0]
        assert first.startswith(
            "Slurm job 7 (engine verb 'train') ended FAILED (exit code 1) on node n2, rank 1: a rank died by signal 9, "
            "then srun terminated the node; node n1, rank 0: Exited with exit code 1."
        ), first


@pytest.mark.parametrize("srun_first", ["n1", "n2"])
def test_failure_message_leads_with_the_own_failure_then_the_earliest(srun_first):
    """No rank signalled: a rank's own exception comes before a peer's collective timeout; between
    two failures of the same kind, torchrun's earlier recorded time leads."""
    info = JobInfo(job_id="8", state="FAILED", exit_code="1:0", nodes="n[1-2]")
    own = ["[rank 1|error] RuntimeError: boom", *_torchrun_summary(1, 1, "07:32:21", "900000")]
    timeout = [
        (
            "[rank 0|error] RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for "
            "recv operation to complete"
        ),
        *_torchrun_summary(0, 1, "07:32:20", "100000"),
    ]
    task = {"n1": 0, "n2": 1}
    batch = [
        f"srun: error: {n}: task {task[n]}: Exited with exit code 1"
        for n in ((srun_first, "n2") if srun_first == "n1" else ("n2", "n1"))
    ]
    assert " on node n2, rank 1: " in failure_message(info, batch, {"n1": timeout, "n2": own}).splitlines()[0]
    later = ["[rank 0|error] ValueError: bad batch", *_torchrun_summary(0, 1, "07:32:20", "100000")]
    assert " on node n1, rank 0: " in failure_message(info, batch, {"n1": later, "n2": own}).splitlines()[0]


def test_failure_message_leads_with_the_rank_that_raised_though_srun_terminated_its_node():
    """Rank 1 (n2) raised; rank 0 (n1) saw gloo's connection close, its agent exited
    first, and srun terminated n2 while n2's agent was still reporting its own exit code 1."""
    info = JobInfo(job_id="2", state="FAILED", exit_code="143:0", nodes="n[1-2]")
    nodes = {
        "n1": [
            (
                "[rank0]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
                "Connection closed by peer "
                "[127.0.0.1]:2786. This is typically caused by a remote worker crashing."
            ),
            *_torchrun_summary(0, 1, "03:33:41", "200000"),
        ],
        "n2": ["[rank1]: RuntimeError: probe failure on purpose on n2", *_torchrun_summary(1, 1, "03:33:41", "100000")],
    }
    batch = ["srun: error: n1: task 0: Exited with exit code 1", "srun: error: n2: task 1: Terminated"]
    first = failure_message(info, batch, nodes, what="probe").splitlines()[0]
    assert first.startswith(
        "Slurm job 2 (probe) ended FAILED (exit code 143) on node n2, rank 1: Exited with exit code 1, then srun "
        "terminated the node; node n1, rank 0: Exited with exit code 1."
    ), first
    # A terminated node whose ranks only lost a peer is no cause: srun's own word stands alone.
    nodes["n2"] = ["[rank1]: RuntimeError: Connection reset by peer", *_torchrun_summary(1, 1, "03:33:41", "100000")]
    first = failure_message(info, batch, nodes, what="probe").splitlines()[0]
    assert " on node n1, rank 0: Exited with exit code 1." in first and "node n2" not in first, first


@pytest.mark.parametrize(
    "state, words",
    [
        ("TIMEOUT", "time limit"),
        ("NODE_FAIL", "stopped responding"),
        ("OUT_OF_MEMORY", "memory"),
        ("CANCELLED", "cancelled"),
    ],
)
def test_failure_message_explains_each_state(state, words):
    msg = failure_message(JobInfo(job_id="5", state=state, nodes="n[1-2]", reason="None"), [], {})
    assert msg.startswith(f"Slurm job 5 ended {state} on nodes n[1-2].") and words in msg


def test_node_logs_yields_complete_lines_per_node(tmp_path):
    logs = NodeLogs(tmp_path, "9")
    (tmp_path / "job-9.n1.log").write_text("a\nb")
    (tmp_path / "job-9.batch.log").write_text("start\n")
    assert list(logs.poll()) == [("batch", "start"), ("n1", "a")]
    with open(tmp_path / "job-9.n1.log", "a") as fh:
        fh.write("c\nd")
    (tmp_path / "job-9.n2.log").write_text("x\n")
    assert list(logs.poll()) == [("n1", "bc"), ("n2", "x")]
    assert list(logs.poll(final=True)) == [("n1", "d")]


def test_config_rules_for_the_slurm_backend(tiny_model_dir, tmp_path):
    raw = tiny_config_raw(tiny_model_dir, tmp_path / "run")
    raw["cpt"]["launch"] = {"backend": "slurm", "nnodes": 2, "nproc_per_node": 1, "slurm": {"partition": "debug"}}
    cfg = parse_config(raw)  # nnodes 2 needs no rdzv_endpoint: the job's first node hosts it
    assert cfg.cpt.launch.slurm.partition == "debug"
    raw["cpt"]["launch"]["slurm"]["extra_sbatch_args"] = ["--qos=high", "--nodes=3"]
    raw["sft"]["launch"] = {"backend": "local", "slurm": {"partition": "debug"}}
    with pytest.raises(ConfigError) as err:
        parse_config(raw)
    fields = [f for f, _ in err.value.problems]
    assert fields == ["cpt.launch.slurm.extra_sbatch_args[1]", "sft.launch.slurm"], err.value.problems


# -- integration tier: the real two-node cluster ------------------------------------------------


def _submit(cluster, tmp_path: Path, mode: str, **launch_kw) -> tuple[SlurmCli, str, NodeLogs]:
    launch = LaunchConfig(backend="slurm", nnodes=launch_kw.pop("nnodes", 2), nproc_per_node=1, **launch_kw)
    logs_dir = tmp_path / "logs"
    logs_dir.mkdir()
    script = tmp_path / "job.sh"
    script.write_text(render_batch_script([PROBE, mode], launch, f"probe-{mode}", logs_dir, REPO))
    cli = SlurmCli()
    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    job_id = cli.sbatch(script, env=env)
    return cli, job_id, NodeLogs(logs_dir, job_id)


def _collect(lines: list[tuple[str, str]]):
    return lambda node, line: lines.append((node, line))


@pytest.mark.integration
def test_two_node_torchrun_rendezvous_across_n1_and_n2(slurm_cluster, tmp_path):
    cli, job_id, logs = _submit(slurm_cluster, tmp_path, "allreduce")
    lines: list[tuple[str, str]] = []
    t0 = time.monotonic()
    info = wait_for_job(cli, job_id, logs, _collect(lines), poll_s=0.5, timeout=240)
    elapsed = time.monotonic() - t0
    assert info.state == "COMPLETED", failure_message(info, [ln for n, ln in lines if n == "batch"], {})
    probes = {}
    for node, line in lines:
        if "@@probe " in line:
            rec = json.loads(line.split("@@probe ", 1)[1])
            probes[rec["rank"]] = (node, rec)
    # One rank per emulated node, both in one world of 2, and the all_reduce saw both (1 + 2).
    assert sorted(probes) == [0, 1], lines
    assert {node for node, _ in probes.values()} == {"n1", "n2"}
    for node, rec in probes.values():
        assert rec["node"] == node and rec["world"] == 2 and rec["sum"] == 3.0 and rec["job"] == job_id
    assert set(logs.node_files()) == {"n1", "n2"}
    rdzv = [json.loads(ln.split("@@slurm ", 1)[1]) for n, ln in lines if n == "batch" and "@@slurm " in ln]
    assert rdzv and rdzv[0]["nodes"] == "n1 n2" and rdzv[0]["rdzv_endpoint"].startswith("127.0.0.1:")
    print(f"two-node rendezvous job {job_id}: submit to COMPLETED in {elapsed:.1f}s")


@pytest.mark.integration
def test_failing_rank_maps_to_failed_naming_node_and_rank(slurm_cluster, tmp_path):
    cli, job_id, logs = _submit(slurm_cluster, tmp_path, "fail")
    lines: list[tuple[str, str]] = []
    info = wait_for_job(cli, job_id, logs, _collect(lines), poll_s=0.5, timeout=240)
    assert info.state == "FAILED" and info.exit_code != "0:0"
    by_node: dict[str, list[str]] = {}
    for node, line in lines:
        by_node.setdefault(node, []).append(line)
    msg = failure_message(info, by_node.pop("batch", []), by_node, what="probe")
    first = msg.splitlines()[0]
    assert first.startswith(f"Slurm job {job_id} (probe) ended FAILED"), msg
    # c10d hands out global ranks at the rendezvous, so n2's rank is whichever it reported.
    n2_rank = next(json.loads(ln.split("@@probe ", 1)[1])["rank"] for ln in by_node["n2"] if "@@probe " in ln)
    assert f"node n2, rank {n2_rank}: Exited with exit code 1" in first, msg
    assert "RuntimeError: probe failure on purpose on n2" in msg, msg


@pytest.mark.integration
def test_cancelled_job_maps_to_cancelled_and_leaves_no_process(slurm_cluster, tmp_path):
    cli, job_id, logs = _submit(slurm_cluster, tmp_path, "sleep")
    seen: list[tuple[str, str]] = []
    deadline = time.monotonic() + 120
    while sum(" ready pid=" in ln for _, ln in seen) < 2:
        assert time.monotonic() < deadline, f"ranks never got ready: {seen}"
        seen += list(logs.poll())
        info = cli.job(job_id)
        assert info is not None and info.active, info
        time.sleep(0.3)
    t0 = time.monotonic()
    cli.cancel(job_id)
    info = wait_for_job(cli, job_id, logs, _collect(seen), poll_s=0.3, timeout=60)
    ended = time.monotonic() - t0
    assert info.state == "CANCELLED", info
    msg = failure_message(info, [], {})
    assert msg.startswith(f"Slurm job {job_id} ended CANCELLED (signal 15) on nodes n[1-2]") and "cancelled" in msg
    # KillWait=2 on the test cluster: SIGTERM, then SIGKILL of anything left, a few seconds at most.
    deadline = time.monotonic() + 30
    while slurm_cluster.leftovers() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert slurm_cluster.leftovers() == []
    print(f"cancel of job {job_id}: CANCELLED in {ended:.1f}s")


@pytest.mark.integration
def test_preflight_accepts_a_fitting_stage(slurm_cluster):
    assert preflight(_launch(partition="debug"), "cpt.launch", tp_pp=2) == []
    assert preflight(_launch(), "cpt.launch", tp_pp=1) == []  # the default partition


@pytest.mark.integration
def test_preflight_refuses_missing_partition_and_too_many_nodes(slurm_cluster):
    problems = preflight(_launch(partition="gpu-h100"), "cpt.launch")
    assert [f for f, _ in problems] == ["cpt.launch.slurm.partition"]
    assert "'gpu-h100' does not exist" in problems[0][1] and "debug" in problems[0][1]

    too_many = LaunchConfig(backend="slurm", nnodes=3, nproc_per_node=2, slurm=SlurmConfig(partition="debug"))
    problems = preflight(too_many, "sft.launch", tp_pp=4)
    assert [f for f, _ in problems] == ["sft.launch.nnodes", "sft.launch.nnodes"], problems
    assert "not a multiple of tp_size*pp_size = 4" in problems[0][1]
    assert "3 nodes do not fit partition 'debug': it has 2 node(s)" in problems[1][1]

    gpus = LaunchConfig(
        backend="slurm", nnodes=2, nproc_per_node=1, slurm=SlurmConfig(partition="debug", gpus_per_node=1)
    )
    problems = preflight(gpus, "cpt.launch")
    assert [f for f, _ in problems] == ["cpt.launch.slurm.gpus_per_node"]
    assert "0 of its nodes have that many GPUs" in problems[0][1]


@pytest.mark.integration
def test_preflight_refuses_an_unreachable_controller_within_its_timeout(slurm_cluster, tmp_path):
    from support.servers.seaweed import free_ports

    dead = free_ports(1)[0]
    conf = tmp_path / "slurm.conf"
    conf.write_text(
        "\n".join(
            f"SlurmctldPort={dead}" if ln.startswith("SlurmctldPort=") else ln
            for ln in slurm_cluster.conf.read_text().splitlines()
        )
        + "\n"
    )
    t0 = time.monotonic()
    problems = preflight(_launch(partition="debug"), "cpt.launch", cli=SlurmCli(env={"SLURM_CONF": str(conf)}))
    elapsed = time.monotonic() - t0
    assert [f for f, _ in problems] == ["cpt.launch.slurm"], problems
    assert "the Slurm controller does not answer" in problems[0][1]
    assert elapsed < 30, elapsed
    print(f"unreachable controller refused in {elapsed:.1f}s: {problems[0][1]}")
