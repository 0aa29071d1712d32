#!/usr/bin/env bash
# System packages the test suite needs beyond the venv: Slurm (controller, node daemon, clients)
# and MUNGE (Slurm's authentication), for the real two-node test cluster of tests/servers/slurm.py.
#
#   sudo bash scripts/install_system.sh     # Debian/Ubuntu, root; .ci/run calls it before `make test`
#
# Idempotent: when slurmctld, slurmd, sbatch and munged are already on PATH it prints one line and
# exits (well under a second). Otherwise it installs `slurm-wlm` and `munge` with apt-get, and runs
# `apt-get update` only when the package lists do not know the packages or are stale (an install
# that fails on a missing .deb). Nothing is started or enabled here: the test fixture runs its own
# daemons with its own config, and Debian's packaged services would fight it for the ports.
set -euo pipefail

PATH="$PATH:/usr/sbin:/sbin"
need=(slurmctld slurmd sbatch munged)
missing=()
for bin in "${need[@]}"; do
  command -v "$bin" >/dev/null 2>&1 || missing+=("$bin")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install_system: slurm and munge present ($(slurmctld -V 2>/dev/null || echo slurmctld))"
  exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
  echo "install_system: missing ${missing[*]}; run as root (or: sudo apt-get install slurm-wlm munge)" >&2
  exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_system: missing ${missing[*]} and no apt-get here; install Slurm (slurmctld, slurmd, clients) and MUNGE with your distribution's packages" >&2
  exit 1
fi

start=$(date +%s)
export DEBIAN_FRONTEND=noninteractive
# Other apt users on a shared machine hold the dpkg lock for a while; wait instead of failing.
APT=(apt-get -o DPkg::Lock::Timeout=600 -q -y)
pkgs=(slurm-wlm munge)

known() {
  local p
  for p in "${pkgs[@]}"; do
    apt-cache policy "$p" 2>/dev/null | grep -q 'Candidate: [0-9]' || return 1
  done
}
install() { "${APT[@]}" install --no-install-recommends "${pkgs[@]}"; }

updated=0
if ! known; then
  echo "install_system: package lists do not know ${pkgs[*]}; apt-get update"
  "${APT[@]}" update
  updated=1
fi
# policy-rc.d exit 101 keeps the packages' postinst scripts from starting their system services.
policy=/usr/sbin/policy-rc.d
own_policy=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && own_policy=1
fi
trap '[ "$own_policy" = 1 ] && rm -f "$policy"' EXIT
if ! install; then
  [ "$updated" = 1 ] && exit 1
  echo "install_system: install failed, package lists may be stale; apt-get update and retry"
  "${APT[@]}" update
  install
fi
echo "install_system: installed ${pkgs[*]} in $(( $(date +%s) - start )) s ($(slurmctld -V))"
