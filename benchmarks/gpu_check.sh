#!/usr/bin/env bash
# The GPU validation in one command, on a machine with one CUDA GPU and no internet:
#   bash benchmarks/gpu_check.sh [benchmarks/gpu_check.py options, e.g. --skip-tests --budget-s 480]
# From the CPU machine, with the wheels fetched first by `bash benchmarks/gpu_wheels.sh`, the device
# tool's call is:
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=600)
#
# 1. installs the carried wheels (.whl/) into $GPU_CHECK_SITE (default /tmp/site) and puts it first on
#    PYTHONPATH, over the image's own transformers 5 / huggingface_hub 1 / tokenizers 0.23; torch is
#    the image's CUDA build (python3 there is /opt/torch/.venv/bin/python3);
# 2. writes an import-only stand-in for bitsandbytes when none is importable: colossalai 0.5.0's
#    optimizer package imports GaLore's 8-bit optimizer class at import time (colossalai.nn.optimizer
#    -> galore_torch / .galore -> bitsandbytes.optim.optimizer.Optimizer2State) and this project never
#    uses it; the real wheel (43 MB) does not fit in what a device call carries. Instantiating the
#    stand-in raises. There is no dist-info, so transformers reports bitsandbytes unavailable;
# 3. runs benchmarks/gpu_check.py, its console copied to $OUT/console.log ($OUT/gpu_check.log holds
#    every subprocess's output, $OUT/summary.json the checks and figures).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/site}
OUT=${OUT:-$PWD/build/gpu-check/out}
export OUT
mkdir -p "$OUT" "$SITE"
t0=$(date +%s)

if ls .whl/*.whl >/dev/null 2>&1; then
  echo "gpu_check.sh: installing $(ls .whl/*.whl | wc -l) carried wheels into $SITE"
  "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl 2>&1 | grep -v "is ignored\|is not a directory" || true
else
  echo "gpu_check.sh: no .whl/ here: using $PY's packages as they are (run benchmarks/gpu_wheels.sh and carry .whl)"
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

if ! PYTHONPATH="$SITE" "$PY" -c "import bitsandbytes.optim.optimizer" 2>/dev/null; then
  echo "gpu_check.sh: writing the import-only bitsandbytes stand-in into $SITE"
  mkdir -p "$SITE/bitsandbytes/optim"
  cat > "$SITE/bitsandbytes/__init__.py" <<'EOF'
"""Import-only stand-in written by benchmarks/gpu_check.sh: colossalai 0.5.0 imports GaLore's 8-bit
optimizer class at import time; cpt-to-sft never uses it. Not the real bitsandbytes."""
import types

__version__ = "0.0.0"
nn = types.SimpleNamespace()  # peft's is_bnb_4bit_available() asks hasattr(bnb.nn, "Linear4bit")
EOF
  : > "$SITE/bitsandbytes/optim/__init__.py"
  cat > "$SITE/bitsandbytes/optim/optimizer.py" <<'EOF'
class Optimizer2State:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("bitsandbytes here is an import-only stand-in (benchmarks/gpu_check.sh): 8-bit optimizers are unavailable")
EOF
fi

if ! "$PY" -c "import prefect, transformers, colossalai.nn.optimizer" ; then
  echo "gpu_check.sh: prefect / transformers / colossalai do not import with $PY and PYTHONPATH=$PYTHONPATH" >&2
  exit 1
fi

if [ -z "${CUDA_HOME:-}" ] && command -v nvcc >/dev/null; then
  CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
  export CUDA_HOME
fi
export MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PREFECT_SERVER_ANALYTICS_ENABLED=false
echo "gpu_check.sh: setup took $(( $(date +%s) - t0 ))s; python $("$PY" -c 'import sys; print(sys.executable)'); CUDA_HOME=${CUDA_HOME:-unset}"

"$PY" benchmarks/gpu_check.py "$@" 2>&1 | tee "$OUT/console.log"
exit "${PIPESTATUS[0]}"
