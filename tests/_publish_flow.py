"""The CPT half of the runbook as one small Prefect flow (load -> prepare -> boost & shard -> train CPT), for
the publish flow tests (tests/test_publish_flow.py), and `shard_only`, its first three stages, which
make the shard those tests share. The stage tasks are the real ones.

    python -c "from tests._publish_flow import cpt_only; print(cpt_only('CONFIG.yaml'))"

Not the real flow with `stop_after="train_cpt"`: that one also writes run.json and its lease on
the run root when it ends, and the store-outage test ends its first run with the S3 server down
(the lease it could not remove would then refuse the retry); the slow-store test reuses the
staged copies the real flow prunes at its end.
"""

from __future__ import annotations

from prefect import flow

from tasks.core.config.load import load_config
from tasks.flowkit.stage import StageResult, outcome
from tasks.stages.load import load_from_hf
from tasks.stages.prepare_data import prepare_data
from tasks.stages.train import boost_and_shard, train_cpt


@flow(name="cpt-shard-test")
def shard_only(config: str) -> StageResult:
    cfg = load_config(config)
    base = outcome(load_from_hf(cfg, return_state=True))
    data = outcome(prepare_data(cfg, "cpt", base, return_state=True))
    return outcome(boost_and_shard(cfg, base, data, return_state=True))


@flow(name="cpt-publish-test")
def cpt_only(config: str) -> StageResult:
    cfg = load_config(config)
    base = outcome(load_from_hf(cfg, return_state=True))
    data = outcome(prepare_data(cfg, "cpt", base, return_state=True))
    start = outcome(boost_and_shard(cfg, base, data, return_state=True))
    return outcome(train_cpt(cfg, start, return_state=True))
