#!/usr/bin/env bash
# The GPU validation in one command, on a machine with one CUDA GPU and no internet:
#   bash benchmarks/gpu_check.sh [benchmarks/gpu_check.py options, e.g. --skip-tests --budget-s 480]
#   bash benchmarks/gpu_check.sh --tests-only [pytest options]   # the set-up, then only tests/test_gpu.py
#   PYTHON=.venv/bin/python bash benchmarks/gpu_check.sh --smoke   # CPU: the same set-up, then gpu_check.py's smoke run
# From the CPU machine, with the wheels fetched first by `bash benchmarks/gpu_wheels.sh`, the device
# tool's call is:
#   run(command="bash benchmarks/gpu_check.sh --budget-s 490", carry=[".whl"], timeout_s=575)
# (the installs and import checks take ~30-60 s before the budget starts; the machine's start is
# not in timeout_s but counts against the session's device time)
#
# 1. installs the carried wheels ($GPU_CHECK_WHEELS, default .whl/) into $GPU_CHECK_SITE (default /tmp/site) and puts it first on
#    PYTHONPATH, over the image's own transformers 5 / huggingface_hub 1 / tokenizers 0.23; torch is
#    the image's CUDA build (python3 there is /opt/torch/.venv/bin/python3);
# 2. writes an import-only stand-in for bitsandbytes when none is importable: colossalai 0.5.0's
#    optimizer package imports GaLore's 8-bit optimizer class at import time (colossalai.nn.optimizer
#    -> galore_torch / .galore -> bitsandbytes.optim.optimizer.Optimizer2State) and this project never
#    uses it; the real wheel (43 MB) does not fit in what a device call carries. Instantiating the
#    stand-in raises. There is no dist-info, so transformers reports bitsandbytes unavailable;
# 3. finds CUDA_HOME (the toolkit nvcc reports) and the cuBLAS/cuSPARSE/cuSOLVER headers torch's
#    ATen/cuda headers include (CPATH, from the image's pip nvidia-* packages when the toolkit lacks
#    them), which ColossalAI's JIT-built fused-Adam kernel needs;
# 4. runs benchmarks/gpu_check.py, its console copied to $OUT/console.log ($OUT/gpu_check.log holds
#    every subprocess's output, $OUT/summary.json the checks and figures).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/site}
WHL=${GPU_CHECK_WHEELS:-.whl}  # the CPU smoke test points this at an empty folder: .whl/ holds cp312 wheels for the GPU image
OUT=${OUT:-$PWD/build/gpu-check/out}
export OUT
mkdir -p "$OUT" "$SITE"
t0=$(date +%s)

if ls "$WHL"/*.whl >/dev/null 2>&1; then
  echo "gpu_check.sh: installing $(ls "$WHL"/*.whl | wc -l) carried wheels into $SITE"
  "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$WHL"/*.whl 2>&1 | grep -v "is ignored\|is not a directory" || true
else
  echo "gpu_check.sh: no wheels in $WHL/: using $PY's packages as they are (run benchmarks/gpu_wheels.sh and carry .whl)"
fi
# the checkout after the wheels: the project is not installed on the GPU machine, support/ never is
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"

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

# A guard for the carried wheels and the stand-in on the GPU machine. The CPU smoke skips it: there the stack
# is the venv's own, which the model, pre-flight and plain-baseline steps import in turn (and every test of the
# suite before them), and the guard's one import of all of it cost the smoke ~10 CPU-s.
case " $* " in *" --smoke "*) smoke=1 ;; *) smoke=0 ;; esac
if [ "$smoke" = 0 ] && ! "$PY" -c "import prefect, transformers, colossalai.nn.optimizer" ; then
  echo "gpu_check.sh: prefect / transformers / colossalai do not import with $PY and PYTHONPATH=$PYTHONPATH" >&2
  exit 1
fi

# CUDA_HOME for ColossalAI's JIT kernels: the toolkit nvcc itself reports (its TOP, which sees
# through a wrapper script such as /usr/local/bin/nvcc -> exec /usr/local/cuda-13.0/bin/nvcc), else
# the resolved nvcc's grandparent, else /usr/local/cuda; the first that holds include/cuda_runtime.h.
if [ -z "${CUDA_HOME:-}" ] && command -v nvcc >/dev/null; then
  probe=$(mktemp -d)
  : > "$probe/k.cu"
  top=$(cd "$probe" && nvcc --dryrun -c k.cu 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)
  rm -rf "$probe"
  for c in "${top:+$(readlink -f "$top")}" "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")" /usr/local/cuda; do
    if [ -n "$c" ] && [ -x "$c/bin/nvcc" ] && [ -f "$c/include/cuda_runtime.h" ]; then CUDA_HOME=$c; break; fi
  done
  [ -n "${CUDA_HOME:-}" ] && export CUDA_HOME
fi
# torch's ATen/cuda headers (included by the fused-Adam kernel) need cublas_v2.h, cublasLt.h,
# cusparse.h and cusolverDn.h. A toolkit with only the compiler lacks them; the image's pip
# nvidia-cublas / -cusparse / -cusolver packages ship them: put their include folders on CPATH
# (read by g++, which nvcc preprocesses with).
hdrs=""
for h in cublas_v2.h cublasLt.h cusparse.h cusolverDn.h cusolver_common.h; do
  [ -n "${CUDA_HOME:-}" ] && [ -f "$CUDA_HOME/include/$h" ] && continue
  nv=$("$PY" -c "import nvidia, sys; print(' '.join(nvidia.__path__))" 2>/dev/null)
  d=$(find $nv /usr/local/cuda*/ /usr/include -maxdepth 5 -name "$h" -path "*include*" 2>/dev/null | head -1)
  if [ -n "$d" ]; then
    d=$(dirname "$d")
    case ":$hdrs:" in *":$d:"*) ;; *) hdrs="${hdrs:+$hdrs:}$d" ;; esac
  else
    echo "gpu_check.sh: $h not found (CUDA_HOME=${CUDA_HOME:-unset}): the fused-Adam kernel will not build" >&2
  fi
done
if [ -n "$hdrs" ]; then
  export CPATH="$hdrs${CPATH:+:$CPATH}"
  echo "gpu_check.sh: CUDA library headers from $hdrs (CPATH)"
fi
echo "gpu_check.sh: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1);" \
  "nvcc $(nvcc --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/\1/p'); $(g++ --version 2>/dev/null | head -1); $(nproc) CPUs"
export MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PREFECT_SERVER_ANALYTICS_ENABLED=false
echo "gpu_check.sh: setup took $(( $(date +%s) - t0 ))s; python $("$PY" -c 'import sys; print(sys.executable)'); CUDA_HOME=${CUDA_HOME:-unset}"

if [ "${1:-}" = "--tests-only" ]; then  # only tests/test_gpu.py, after the same set-up (its first launch JIT-builds the kernels)
  shift
  "$PY" -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py tests/test_gpu_lora.py tests/test_eval_placement.py tests/test_gpu_construction.py "$@" 2>&1 | tee "$OUT/console.log"
  exit "${PIPESTATUS[0]}"
fi
"$PY" benchmarks/gpu_check.py "$@" 2>&1 | tee "$OUT/console.log"
exit "${PIPESTATUS[0]}"
