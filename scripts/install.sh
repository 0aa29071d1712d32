#!/usr/bin/env bash
# The one install step, used by both README commands and by CI:
#   bash scripts/install.sh            # creates ./.venv and installs everything, idempotent
# Order matters:
#   1. torch first, so a build already present in the venv (CPU here, CUDA on a GPU node) is kept;
#   2. the project with its pinned stack (prefect 3.9, transformers 4.57.6, tokenizers 0.22.2, peft 0.21.2,
#      huggingface-hub<1.0, ...); a venv installed from older pins reinstalls (the stamp is their hash);
#   3. colossalai 0.5.0 with --no-deps: its own pins clash with Prefect 3.9 (uvicorn), torch and peft
#      (docs/versions.md: which transformers and peft it runs with);
#   4. lm-eval, datasets and evaluate with --no-deps (the benchmark stage): every datasets release
#      caps fsspec below the pinned one, or needs a huggingface-hub transformers 4.57.6 refuses
#      (pyproject.toml's [benchmark] extra lists the rest of what they need).
# Never run `pip check` here: it reports exactly those deliberate clashes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
COLOSSALAI_SPEC=${COLOSSALAI_SPEC:-colossalai==0.5.0}
LM_EVAL_SPECS=(lm-eval==0.4.13 datasets==4.8.5 evaluate==0.4.6)

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
PIP=(pip_quiet "$VPY" -m pip install --disable-pip-version-check -q)
# This machine's pip config lists local indexes that may not exist; drop that noise, keep errors.
pip_quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

if "$VPY" -c "import torch" 2>/dev/null; then
  echo "install: keeping torch $("$VPY" -c 'import torch; print(torch.__version__)')"
else
  echo "install: $TORCH_SPEC"
  "${PIP[@]}" "$TORCH_SPEC"
fi

stamp=.venv/.cpt-to-sft-installed
want=$(cat pyproject.toml scripts/install.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$VPY" -c "import colossalai, prefect, lm_eval" 2>/dev/null; then
  echo "install: .venv is up to date"
  exit 0
fi

echo "install: project and its pinned stack"
"${PIP[@]}" -e '.[test]'
echo "install: $COLOSSALAI_SPEC (--no-deps)"
"${PIP[@]}" --no-deps "$COLOSSALAI_SPEC"
echo "install: ${LM_EVAL_SPECS[*]} (--no-deps)"
"${PIP[@]}" --no-deps "${LM_EVAL_SPECS[@]}"
"$VPY" -c "import colossalai, prefect, transformers, torch; print('install: ok', 'torch', torch.__version__, 'colossalai', colossalai.__version__, 'prefect', prefect.__version__)"
echo "$want" > "$stamp"
