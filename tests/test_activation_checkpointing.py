"""Activation checkpointing changes memory, never the math: one torchrun launch (2 CPU ranks) trains
the demo's tiny Llama 3 steps with and without it under hybrid_parallel tp=2 fp32, hybrid_parallel
pp=2 fp32 (shardformer's pipeline gradient-checkpoint config) and low_level_zero ZeRO-2 bf16 (ZeRO
needs bf16 by the layout rules), through the engine's own Engine (plugin, boost, train_step).

    pytest -m distributed tests/test_activation_checkpointing.py -s

Measured here: the losses of every step and the final weights are bitwise equal in all three,
bf16 included (the recompute runs the same ops on the same inputs); so the test asserts bitwise.
That each decoder layer really ran twice (the forward, then the recompute in the backward) is
counted with forward hooks, so a switch that did nothing would fail.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.distributed

PLUGINS = ("hp-tp2-fp32", "hp-pp2-fp32", "llz2-bf16")


def test_losses_and_weights_are_bitwise_the_same_with_activation_checkpointing(tiny_model_dir, tmp_path):
    cases = [f"{p}:{mode}" for p in PLUGINS for mode in ("off", "on")]
    out = tmp_path / "out"
    # the benchmark's own launch (one torchrun, every case), run as the script it is
    argv = [sys.executable, "benchmarks/activation_checkpointing.py", "cases", "--model", str(tiny_model_dir)]
    argv += ["--cases", ",".join(cases), "--out", str(out), "--steps", "3", "--seq-len", "64", "--mbs", "2"]
    p = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=900, check=False)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    recs = json.loads((out / "records.json").read_text())
    assert {r["case"] for r in recs} == set(cases) and len(recs) == 2 * len(cases)
    for plugin in PLUGINS:
        off = {r["rank"]: r for r in recs if r["case"] == f"{plugin}:off"}
        on = {r["rank"]: r for r in recs if r["case"] == f"{plugin}:on"}
        for rank in (0, 1):
            assert not off[rank]["activation_checkpointing"] and on[rank]["activation_checkpointing"], plugin
            assert off[rank]["layer_calls"] > 0 and on[rank]["layer_calls"] == 2 * off[rank]["layer_calls"], (
                plugin,
                rank,
            )
            assert len(on[rank]["losses"]) == 3 and all(math.isfinite(x) for x in on[rank]["losses"])
            assert on[rank]["losses"] == off[rank]["losses"], (plugin, rank, off[rank]["losses"], on[rank]["losses"])
            assert on[rank]["weights"] == off[rank]["weights"], (plugin, rank)
