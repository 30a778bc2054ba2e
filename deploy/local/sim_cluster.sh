#!/usr/bin/env bash
# Simulated hosts on this one Linux machine (asyncrl/bench/sim_cluster.py), for trying a run over several
# hosts without them: each host is a network + pid + mount + UTS namespace with its own address
# (10.213.0.<i+1>/24), /dev/shm, /tmp, hostname and (with --ray) Ray node, on a bridge in a namespace of its own.
#
#   sim_cluster.sh [--name N] up K [--ray] [--cpus C]   make K hosts (a Ray head on host 0, a worker on the others)
#   sim_cluster.sh [--name N] exec I -- CMD ...          run CMD on host I (its network, /dev/shm, /tmp, processes)
#   sim_cluster.sh [--name N] down                       end every process of the cluster and delete it
#   sim_cluster.sh status                                the clusters this machine holds
#
# --name (default `sim`) may also come after the subcommand; it is passed on in front of it. Needs root,
# iproute2 (ip) and util-linux (nsenter, unshare). A recipe to run on it: deploy/local/README.md.
# Env: PYTHON (default: the repository's .venv/bin/python, else python3).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$REPO/.venv/bin/python" ]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi

die() { echo "sim_cluster.sh: $*" >&2; exit 2; }

[ $# -gt 0 ] || die "usage: sim_cluster.sh [--name N] up K [--ray] | exec I -- CMD ... | down | status (see the header of this file)"
[ "$(id -u)" = 0 ] || die "needs root (network, mount and pid namespaces): sudo $0 $*"

# --name N (or --name=N) anywhere before `--` goes in front of the subcommand, where the module's parser reads it
name=() rest=()
while [ $# -gt 0 ]; do
  case "$1" in
    --name) [ $# -ge 2 ] || die "--name needs a value"; name=(--name "$2"); shift 2 ;;
    --name=*) name=(--name "${1#--name=}"); shift ;;
    --) rest+=("$@"); break ;;
    *) rest+=("$1"); shift ;;
  esac
done

# the module is imported from the repository (no install needed); `exec` keeps the caller's working directory
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" -m asyncrl.bench.sim_cluster ${name[@]+"${name[@]}"} ${rest[@]+"${rest[@]}"}
