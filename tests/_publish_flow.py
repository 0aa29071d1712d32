"""The CPT half of the runbook as one small Prefect flow (load -> prepare -> boost & shard -> train CPT), for
the publish/teardown flow tests (tests/test_publish_flow.py). The stage tasks are the real ones.

Run as a script it is the cancellation test's driver: it starts a throwaway Prefect server,
runs the flow on the given config, and prints the final state (the test SIGTERMs it first, which
is how a Prefect runner cancels a flow run):

    python -m tests._publish_flow CONFIG.yaml
"""

from __future__ import annotations

import sys

from prefect import flow

from tasks.core.config.load import load_config
from tasks.load import load_from_hf
from tasks.prepare_data import prepare_data
from tasks.stage import StageResult, outcome
from tasks.train import boost_and_shard, train_cpt


@flow(name="cpt-publish-test")
def cpt_only(config: str) -> StageResult:
    cfg = load_config(config)
    base = outcome(load_from_hf(cfg, return_state=True))
    data = outcome(prepare_data(cfg, "cpt", base, return_state=True))
    start = outcome(boost_and_shard(cfg, base, data, return_state=True))
    return outcome(train_cpt(cfg, start, return_state=True))


if __name__ == "__main__":
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        print("driver: flow starting", flush=True)
        state = cpt_only(sys.argv[1], return_state=True)
        print(f"driver: flow ended {state.type.value}: {state.message}", flush=True)
