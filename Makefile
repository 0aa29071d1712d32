# The two README commands:  `make demo`  and  `make test`.  Both install into ./.venv first.
PY := .venv/bin/python
DEMO_MODEL := build/demo-inputs/tiny-llama
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo-inputs demo test test-fast clean

install:
	bash scripts/install.sh

demo-inputs: install
	$(PY) -m tasks.core.models.demo --out $(DEMO_MODEL)

demo: demo-inputs
	$(PY) -m flows.cpt_to_sft --config deployments/configs/tiny-cpu.yaml

# Lint first (ruff, configured in pyproject.toml), then every tier: unit, distributed (torchrun,
# 2 CPU ranks), integration and e2e. GPU tests skip without CUDA. Two pytest-xdist workers: much of
# a test's time waits on servers, sleeps and polls, which the other worker fills. Three were
# measured faster (186 % CPU against 157 %), but two timing-bound tests (the Ctrl-C teardown within
# 10 s, the Slurm killed-rank cause) failed once at three on a loaded machine; two stay until those
# are made robust to it.
test: install
	$(PY) -m ruff check .
	$(PY) -m pytest -q -m "" -n 2 --dist loadgroup --durations=40 tests

# Lint, then the fast unit tier only (no torchrun, no Prefect server).
test-fast: install
	$(PY) -m ruff check .
	$(PY) -m pytest -q tests

clean:
	rm -rf runs build .pytest_cache
