#!/usr/bin/env bash
# System packages the test suite needs beyond the venv: Slurm (controller, node daemon, clients)
# and MUNGE (Slurm's authentication), for the real two-node test cluster of support/servers/slurm.py;
# PostgreSQL 15 (Debian's postgresql-15), the database of the Prefect server the operations test
# runs (support/servers/postgres.py starts a cluster of its own with initdb/pg_ctl).
#
#   sudo bash scripts/install_system.sh     # Debian/Ubuntu, root; .ci/run calls it before `make test`
#
# Idempotent: when slurmctld, slurmd, sbatch, munged and PostgreSQL's initdb are already there it
# prints one line and exits (well under a second). Otherwise it installs what is missing of
# `slurm-wlm`, `munge` and `postgresql-15` with apt-get, and runs
# `apt-get update` only when the package lists do not know the packages or are stale (an install
# that fails on a missing .deb). Nothing is started or enabled here: the test fixture runs its own
# daemons with its own config, and Debian's packaged services would fight it for the ports.
set -euo pipefail

PATH="$PATH:/usr/sbin:/sbin"
need=(slurmctld slurmd sbatch munged)
missing=()
pkgs=()
for bin in "${need[@]}"; do
  command -v "$bin" >/dev/null 2>&1 || missing+=("$bin")
done
[ ${#missing[@]} -eq 0 ] || pkgs+=(slurm-wlm munge)
# Debian keeps PostgreSQL's server binaries off PATH, under /usr/lib/postgresql/<version>/bin.
if ! command -v initdb >/dev/null 2>&1 && ! compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; then
  missing+=(initdb)
  pkgs+=(postgresql-15)
fi
if [ ${#missing[@]} -eq 0 ]; then
  echo "install_system: slurm, munge and postgresql present ($(slurmctld -V 2>/dev/null || echo slurmctld))"
  exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
  echo "install_system: missing ${missing[*]}; run as root (or: sudo apt-get install ${pkgs[*]})" >&2
  exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_system: missing ${missing[*]} and no apt-get here; install Slurm (slurmctld, slurmd, clients), MUNGE and PostgreSQL 15 with your distribution's packages" >&2
  exit 1
fi

start=$(date +%s)
export DEBIAN_FRONTEND=noninteractive
# Other apt users on a shared machine hold the dpkg lock for a while; wait instead of failing.
APT=(apt-get -o DPkg::Lock::Timeout=600 -q -y)

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
echo "install_system: installed ${pkgs[*]} in $(( $(date +%s) - start )) s ($(slurmctld -V 2>/dev/null || echo slurmctld))"
