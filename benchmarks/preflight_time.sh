#!/usr/bin/env bash
# Wall time of `python -m flows.cpt_to_sft --config FILE --check`, imports included (target < 10 s).
#
#   benchmarks/preflight_time.sh [CONFIG]        # default: examples/tiny-cpu.yaml
#   benchmarks/preflight_time.sh --smoke [CONFIG] # one run each instead of three: checks the script runs
#
# Times three runs each of a failing pre-flight (the config with its SFT seq_len over the model's
# max positions and a missing CPT data file) and of the config as given (which passes once
# `python -m tasks.core.models.demo --out build/demo-inputs/tiny-llama` has built the base model),
# and prints the exit codes and the median wall seconds. Nothing is launched and no Prefect
# server is started: --check is a plain function (tasks.flowkit.preflight.run_check_cli).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
RUNS=3
if [ "${1:-}" = "--smoke" ]; then RUNS=1; shift; fi
CFG=${1:-examples/tiny-cpu.yaml}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
"$PY" - "$CFG" "$TMP/bad.yaml" <<'PYEOF'
import sys, yaml
raw = yaml.safe_load(open(sys.argv[1]))
raw["sft"]["seq_len"] = 10**6
raw["cpt"]["data"]["uri"] = "data/sample/does-not-exist.jsonl"
yaml.safe_dump(raw, open(sys.argv[2], "w"))
PYEOF

run() {  # $1 label, $2 config, $3 expected rc
  local times=() rc
  for _ in $(seq "$RUNS"); do
    local t0=$(date +%s.%N)
    set +e; "$PY" -m flows.cpt_to_sft --config "$2" --run-root "$TMP/run" --check >"$TMP/out" 2>&1; rc=$?; set -e
    times+=("$(echo "$(date +%s.%N) - $t0" | bc)")
  done
  if grep -q "unrecognized arguments: --check" "$TMP/out"; then
    echo "flows/cpt_to_sft has no --check yet (see tasks/flowkit/preflight.py: run_check_cli)"; exit 2
  fi
  local median=$(printf '%s\n' "${times[@]}" | sort -n | sed -n "$(( (RUNS + 1) / 2 ))p")
  printf '%-8s rc=%s (expected %s)  median wall %.2f s  runs: %s\n' "$1" "$rc" "$3" "$median" "${times[*]}"
  head -3 "$TMP/out" | sed 's/^/         | /'
}
echo "load: $(cut -d' ' -f1-3 /proc/loadavg), cores: $(nproc)"
run failing "$TMP/bad.yaml" 1
run given "$CFG" "0 if the base model exists"
