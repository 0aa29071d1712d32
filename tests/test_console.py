"""The console reads like a training log; the run's log in the Prefect UI keeps every line.

    PYTHONPATH=$PWD python -m pytest -q tests/test_console.py

Unit tier: the Router fed real lines of a two-rank launch, into a logger with a console handler
filtered as `flows.console.training_log_console` filters Prefect's, and a UI handler that honours
Prefect's `send_to_api`; the step lines and their interval; the end-of-run table; the bitsandbytes
filter of the engine's entry point. The demo's own console is checked in tests/test_flow_e2e.py.
"""

from __future__ import annotations

import logging
import re

import pytest

from flows.console import _TrainingLog
from tasks.core.launch.torchrun import Router
from tasks.core.run.trainlog import (
    LINES,
    SameWarnings,
    TrainLog,
    default_log_every,
    key_figure,
    ranks_label,
    summary_table,
)

# What a two-rank launch wrote (the bitsandbytes line as it was before its filter), in arrival order.
WARNING_1 = (
    "/site-packages/torch/distributed/distributed_c10d.py:4631: UserWarning: No device id is provided via "
    "`init_process_group` or `barrier `."
)
LAUNCH = [
    "[rank 1|warning] " + WARNING_1,
    "[rank 0|detail] engine train cpt: world size 2, CPU (gloo), cpu_compat patched: CpuAccelerator.synchronize",
    "[rank 0|warning] " + WARNING_1,
    (
        "[rank 1|detail] construction peak 11149312 bytes of host memory over the 377143296 at its start (built and "
        "loaded step-000000)"
    ),
    "[rank 1] loaded its shard",
    "[rank 0] starting cpt from step-000000: the sharded base model",
    '[rank 0] @@kernels {"activation_checkpointing": false, "kernels": {"flash_attention": "off: no CUDA"}}',
    (
        '[rank 0] @@progress {"elapsed_s": 0.1, "loss": 6.2, "lr": 0.001, "peak_mem_bytes": 409100288, "peak_mem_rank": '
        '1, "phase": "cpt", "step": 1, "tokens": 256, "total": 2}'
    ),
    "[rank 1|warning] only rank 1 says this",
    '[rank 0] @@checkpoint {"path": "/run/cpt/step-000002", "step": 2}',
    (
        "W1130 11:02:03.400000 4242 torch/distributed/elastic/multiprocessing/api.py:897] Sending process 12 closing "
        "signal SIGTERM"
    ),
]


class _Lines(logging.Handler):
    def __init__(self, ui: bool):
        super().__init__()
        self.ui, self.lines = ui, []
        if not ui:
            self.addFilter(_TrainingLog())

    def emit(self, record: logging.LogRecord) -> None:
        if self.ui and not getattr(record, "send_to_api", True):  # as Prefect's APILogHandler
            return
        self.lines.append((record.levelno, record.getMessage()))


@pytest.fixture
def logs():
    logger = logging.getLogger("test-console-router")
    logger.propagate, logger.level = False, logging.DEBUG
    console, ui = _Lines(ui=False), _Lines(ui=True)
    logger.addHandler(console)
    logger.addHandler(ui)
    yield logger, console, ui
    logger.removeHandler(console)
    logger.removeHandler(ui)


def test_a_warning_every_rank_prints_reaches_the_console_once_naming_them(logs):
    logger, console, ui = logs
    progress = []
    router = Router(logger, on_progress=progress.append, ranks=2)
    for raw in LAUNCH:
        router.line(raw)
    router.close()
    shown = [m for _, m in console.lines]
    assert shown == [
        f"[ranks 0,1] {WARNING_1}",  # once, when the second rank said it
        "[rank 0] starting cpt from step-000000: the sharded base model",
        (
            "[torchrun] W1130 11:02:03.400000 4242 torch/distributed/elastic/multiprocessing/api.py:897] Sending process "
            "12 closing signal SIGTERM"
        ),
        "[rank 1] only rank 1 says this",  # held for its peers; said when the launch ended
    ], shown
    assert console.lines[0][0] == logging.WARNING
    # The UI keeps every line of every rank at the level its writer marked, events included.
    said = [m for _, m in ui.lines]
    assert (
        f"[rank 1] {WARNING_1}" in said and f"[rank 0] {WARNING_1}" in said and f"[ranks 0,1] {WARNING_1}" not in said
    )
    assert any(m.startswith("[rank 1] construction peak") for m in said) and any(
        m.startswith("[rank 0] progress {") for m in said
    )
    assert len(ui.lines) == len(LAUNCH)
    assert [p["step"] for p in progress] == [1]


def test_an_error_line_lets_the_held_warnings_out_first(logs):
    logger, console, _ = logs
    router = Router(logger, ranks=2)
    router.line("[rank 1|warning] deprecated thing")
    router.line("[rank 1|error] engine train failed: RuntimeError: boom")
    assert [m for _, m in console.lines] == [
        "[rank 1] deprecated thing",
        "[rank 1] engine train failed: RuntimeError: boom",
    ]
    assert router.cause == ("rank 1", "engine train failed: RuntimeError: boom")


def test_same_warnings_waits_a_window_then_names_who_said_it():
    now = [0.0]
    w = SameWarnings(ranks=4, window_s=5.0, clock=lambda: now[0])
    assert w.add("rank 2", "x") == [] and w.add("rank 0", "x") == []
    now[0] = 6.0
    assert w.add("rank 1", "y") == [("ranks 0,2", "x")]  # the window passed: said by who had said it
    assert w.flush() == [("rank 1", "y")]
    assert ranks_label(["rank 0", "rank 1", "rank 2", "rank 5"]) == "ranks 0-2,5"
    assert ranks_label(["n1 rank 0", "n2 rank 1"]) == "n1 rank 0, n2 rank 1"


@pytest.mark.parametrize("steps, every", [(8, 1), (30, 2), (100, 5), (2000, 100), (100_000, 5000)])
def test_default_interval_prints_at_most_25_step_lines(steps, every):
    assert default_log_every(steps) == every
    log = TrainLog("cpt", steps)
    lines = [line for s in range(1, steps + 1) if (line := log({"step": s, "total": steps, "loss": 2.0}))]
    assert len(lines) <= LINES and lines[-1].startswith(f"cpt  step {steps}/{steps}")


def test_a_step_line_reads_like_a_training_log():
    log = TrainLog("cpt", 2000, every=120)
    line = None
    for s in range(1, 121):
        rec = {
            "step": s,
            "total": 2000,
            "loss": 2.314,
            "lr": 2e-5,
            "tokens": s * 4120,
            "elapsed_s": s * 0.1,
            "tokens_per_s": 41200.0,
            "step_s": 0.1,
            "padding_frac": 0.03,
            "mfu": 0.38,
            "peak_mem_bytes": int(61.2 * 2**30),
            "peak_mem_rank": 3,
            "eta_s": 11520.0,
        }
        line = log(rec) or line
    assert (
        line
        == "cpt  step 120/2000 | loss 2.314 | lr 2.0e-05 | 41.2k tok/s | pad 3% | mfu 38% | mem 61.2 GiB | eta 3h12m"
    )
    assert log.end(12.0, {"tokens_per_s": 41200.0}).endswith("median 41.2k tok/s | peak mem 61.2 GiB (rank 3)")
    assert log.peak == (int(61.2 * 2**30), 3)


def test_the_run_ends_with_a_table_of_the_stages():
    stages = [
        {
            "stage": "train_cpt",
            "status": "completed",
            "seconds": 13.4,
            "cpu_seconds": 25.1,  # two ranks
            "detail": {"first_loss": 6.24, "final_loss": 4.332},
        },
        {
            "stage": "evaluate_cpt",
            "status": "completed",
            "seconds": 1.0,
            "detail": {"metrics": {"base": {"perplexity": 515.79}, "cpt": {"perplexity": 77.78}}},
        },
        {"stage": "export", "status": "completed", "seconds": 0.2, "detail": {"bytes": 427136, "dtype": "bf16"}},
        {
            "stage": "train_sft",
            "status": "failed",
            "seconds": 3.0,
            "detail": {"error": "rank 1: engine train failed: boom"},
        },
        {"stage": "push_to_hub", "status": "not-run", "seconds": 0.0, "detail": {}},
    ]
    table = summary_table(stages, "/runs/demo").splitlines()
    assert re.match(r"stage\s+status\s+duration\s+CPU\s+key figure", table[0])
    assert re.match(r"train_cpt\s+completed\s+13\.4s\s+25\.1s\s+loss 6\.240 → 4\.332$", table[1])
    assert re.match(r"evaluate_cpt\s+completed\s+1\.0s\s+-\s+held-out", table[2])  # a row without the figure
    assert table[2].endswith("held-out perplexity 515.79 → 77.78") and table[3].endswith("427.1 kB bf16")
    assert (
        table[4].endswith("its cause is the run's last line")
        and "boom" not in "\n".join(table)
        and re.match(r"push_to_hub\s+not-run\s+-\s+-$", table[5])
    )
    assert table[-1].startswith("artifacts: /runs/demo")
    assert (
        key_figure(
            {
                "stage": "gate",
                "status": "failed-gate",
                "detail": {"passed": False, "reasons": ["sft loss did not improve"]},
            }
        )
        == "sft loss did not improve"
    )


def test_the_table_gives_the_benchmark_its_scores_and_prepare_its_truncation_count():
    acc = {"base": 0.6, "export": 0.5714, "change": -0.0286, "drop_pct": 4.76, "higher_is_better": True}
    bench = {
        "metrics": {"tasks": {"veyra_facts": {"acc": acc}, "noise": {"bits_per_byte": {"base": None, "export": 2.5}}}}
    }
    sft = {
        "train_tokens": 12000,
        "heldout_tokens": 800,
        "truncation": {"rule": "drop", "seq_len": 128, "chats": 200, "over_seq_len": 3, "dropped": 3},
    }
    cpt = {"train_tokens": 5000, "heldout_tokens": 0, "truncation": {"rule": "split", "seq_len": 64, "documents": 9}}
    table = summary_table(
        [
            {"stage": "prepare_cpt", "status": "completed", "seconds": 1.0, "detail": cpt},
            {"stage": "prepare_sft", "status": "completed", "seconds": 1.0, "detail": sft},
            {"stage": "benchmark", "status": "completed", "seconds": 9.0, "detail": bench},
        ],
        "/runs/demo",
    ).splitlines()
    assert table[1].endswith("5.0k train tokens, 0 held out"), table[1]
    assert table[2].endswith("12.0k train tokens, 800 held out; 3 of 200 chats over seq_len=128 (drop)"), table[2]
    assert table[3].endswith("veyra_facts acc 0.6 → 0.5714; noise bits_per_byte 2.5"), table[3]


def test_every_process_silences_only_the_harmless_bitsandbytes_kernels_warning():
    """The filter sits on bitsandbytes' logger from `import tasks` on, so the flow's process (peft in a LoRA
    run's merge, evaluation and card) drops the warning as the ranks do."""
    import tasks  # noqa: F401 - installs it
    from tasks.core.models.hf_imports import BNB_CPU_OPS, harmless_bnb_kernels

    def record(exc: BaseException) -> logging.LogRecord:
        return logging.LogRecord(
            BNB_CPU_OPS,
            logging.WARNING,
            "ops.py",
            253,
            "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure ...",
            (exc,),
            None,
        )

    missing = ModuleNotFoundError("No module named 'kernels'", name="kernels")
    assert harmless_bnb_kernels(record(missing)) is False
    assert harmless_bnb_kernels(record(RuntimeError("kernels 0.9 too old"))) is True  # a real failure still shows
    bnb = logging.getLogger("bitsandbytes.backends.cpu.ops")
    assert not bnb.filter(record(missing)) and bnb.filter(record(RuntimeError("kernels 0.9 too old")))


def test_the_cpu_clock_counts_the_flow_process_and_the_children_it_waited_for():
    """A stage's CPU seconds (run.json, the table above): its own threads' and its reaped children's, e.g. the ranks."""
    import subprocess
    import sys
    import time

    from tasks.core.run.cputime import CpuClock

    def burn(seconds: float) -> None:
        end = time.process_time() + seconds
        while time.process_time() < end:
            pass

    clock = CpuClock()
    burn(0.3)
    burn_child = "import time\nend = time.process_time() + 0.4\nwhile time.process_time() < end: pass"
    subprocess.run([sys.executable, "-S", "-c", burn_child], check=True)
    used = clock.read()
    assert used["cpu_children_seconds"] >= 0.4 and used["cpu_seconds"] >= used["cpu_children_seconds"] + 0.3, used
    assert used["cpu_seconds"] < 5.0, used  # only what ran since the clock started
