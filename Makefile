# The two README commands:  `make demo`  and  `make test`.  Both install into ./.venv first.
PY := .venv/bin/python
DEMO_MODEL := build/demo-inputs/tiny-llama
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo-inputs demo test test-fast docs clean

install:
	bash scripts/install.sh

demo-inputs: install
	$(PY) -m tasks.core.models.demo --out $(DEMO_MODEL)

demo: demo-inputs
	.venv/bin/cpt-to-sft run --config examples/tiny-cpu.yaml

# Lint and format check first (ruff, configured in pyproject.toml), then every tier: unit, distributed (torchrun,
# 2 CPU ranks), integration and e2e; tests/test_docs.py builds the docs site with --strict. GPU tests skip without CUDA. Three pytest-xdist workers on two
# cores: much of a test's time waits on servers, sleeps and polls, which the other workers fill
# (measured 186 % CPU at three against 157 % at two). The timing-bound tests hold on a loaded
# machine: the Ctrl-C teardown is well inside its 10 s, and a Slurm failure names the killed rank's
# node first whichever agent srun reports first.
test: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q -m "" -n 3 --dist loadgroup --durations=40 tests

# Lint, then the fast unit tier only (no torchrun, no Prefect server).
test-fast: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q tests

# The documentation site (mkdocs.yml) into build/site; a broken link or anchor fails it.
# `.venv/bin/mkdocs serve` serves it at http://127.0.0.1:8000 while you edit.
docs: install
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

clean:
	rm -rf runs build .pytest_cache
