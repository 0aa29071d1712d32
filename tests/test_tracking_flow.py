"""The demo flow with TensorBoard and MLflow: the session's real `mlflow server`, the embedded
Prefect server, 8 steps per stage on the tiny model. One run (the session's demo run,
tests/conftest.py `demo_run`, tracked to that server) checks every tracking fact.

    python -m pytest -q -m e2e tests/test_tracking_flow.py
"""

from __future__ import annotations

import re

import pytest

from tasks.core.run.tbevents import read_scalars

pytest_plugins = ["tests.conftest_servers"]
STEPS = 8  # the demo run's steps per stage (tests/conftest.py tiny_config_raw)
pytestmark = [pytest.mark.e2e, pytest.mark.integration]


def _progress_descriptions(flow_run_id: str) -> dict[str, str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    keys = ["cpt-progress", "sft-progress"]
    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=keys), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])
            )
        )
    return {a.key: a.description for a in arts}


def test_flow_writes_tensorboard_and_one_mlflow_run_with_two_stage_runs(demo_run, mlflow_server):
    from mlflow import MlflowClient

    from tasks.core.config.load import load_config
    from tasks.core.config.tracking import flatten
    from tests.conftest import DEMO_EXPERIMENT

    run_root, config = demo_run.run_root, demo_run.config
    assert demo_run.raw["tracking"]["mlflow"] == {"uri": mlflow_server.uri, "experiment": DEMO_EXPERIMENT}
    assert demo_run.rc == 0, demo_run.summary
    assert demo_run.raw["cpt"]["max_steps"] == demo_run.raw["sft"]["max_steps"] == STEPS

    client = MlflowClient(mlflow_server.uri)
    runs = client.search_runs([client.get_experiment_by_name(DEMO_EXPERIMENT).experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = {r.info.run_name: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert sorted(children) == ["cpt", "sft"]
    flow_run_id = parent.data.tags["prefect.flow_run_id"]
    assert len(flow_run_id) == 36 and parent.info.status == "FINISHED"
    assert parent.data.tags["export_uri"] == f"{run_root}/export" and len(parent.data.tags["manifest.train_sft"]) == 64
    # params: the whole config, flattened, nothing that looks like a secret
    assert parent.data.params == flatten(load_config(config).model_dump(mode="json"))
    assert not [k for k in parent.data.params if re.search(r"(^|[._])(token|secret|password)($|[._])", k)]
    for phase, child in children.items():
        loss = sorted(client.get_metric_history(child.info.run_id, "loss"), key=lambda m: m.step)
        assert [m.step for m in loss] == list(range(1, STEPS + 1)), phase
        for key in ("lr", "grad_norm", "tokens_per_s", "step_s", "peak_mem_bytes"):
            assert len(client.get_metric_history(child.info.run_id, key)) == STEPS, (phase, key)
        assert child.info.status == "FINISHED"
    # the evaluation stages' metrics: the parent run and the evaluation artifacts' event files
    assert parent.data.metrics["eval.cpt.cpt.perplexity"] > 1 and parent.data.metrics["eval.sft.sft.loss"] > 0
    acc = demo_run.summary["evaluation"]["benchmark"]["tasks"]["veyra_facts"]["acc"]
    assert (
        parent.data.metrics["eval.benchmark.tasks.veyra_facts.acc.base"],
        parent.data.metrics["eval.benchmark.tasks.veyra_facts.acc.export"],
    ) == (acc["base"], acc["export"])
    assert read_scalars(run_root / "eval" / "cpt" / "tensorboard")["eval/cpt.perplexity"][0][0] == STEPS
    assert "eval/sft.loss" in read_scalars(run_root / "eval" / "sft" / "tensorboard")

    # TensorBoard: one point per step per metric in both stages
    for phase in ("cpt", "sft"):
        scalars = read_scalars(run_root / phase / "tensorboard")
        for tag in (
            "train/loss",
            "train/lr",
            "train/grad_norm",
            "perf/tokens_per_s",
            "perf/step_s",
            "perf/peak_mem_bytes",
        ):
            assert [s for s, _ in scalars[tag]] == list(range(1, STEPS + 1)), (phase, tag)

    # the Prefect link: each progress artifact links to its stage's MLflow run
    progress = _progress_descriptions(flow_run_id)
    for phase, child in children.items():
        assert (
            f"[MLflow run]({mlflow_server.uri}/#/experiments/{child.info.experiment_id}/runs/{child.info.run_id})"
            in progress[f"{phase}-progress"]
        )
