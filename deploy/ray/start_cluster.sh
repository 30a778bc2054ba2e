#!/usr/bin/env bash
# One place that starts, joins, stops a Ray cluster for asyncrl and runs a job on it.
# Used by deploy/slurm/asyncrl.sbatch, deploy/local/README.md and tests/deploy/test_two_node_ray.py.
#
#   start_cluster.sh head   [--ip IP] [--port PORT] [--num-cpus N] [--num-gpus N] [--resources JSON]
#                           [--temp-dir DIR] [--block | --pid-file FILE] [-- RAY_START_ARGS...]
#   start_cluster.sh worker --address IP:PORT [--ip IP] [--num-cpus N] [--num-gpus N] [--resources JSON]
#                           [--block | --pid-file FILE] [-- RAY_START_ARGS...]
#   start_cluster.sh run    --address IP:PORT [--wait-nodes N] [--wait-s S] -- asyncrl train RECIPE key=value ...
#   start_cluster.sh stop   --pid-file FILE
#
# --block keeps the node in the foreground (srun, a container's entrypoint): it ends with the job step.
# --pid-file starts it in the background in its own process group and writes that group's id to FILE;
# `stop --pid-file FILE` ends exactly that node (never `ray stop`, which ends every Ray on the host), and
# removes Ray's `ray_current_cluster` file (in the node's temp dir) when the address it names no longer
# answers: `ray.init()` on this host would otherwise try to join the dead cluster instead of starting a
# local one (asyncrl's `ray.enabled=true` then dies with "num_cpus and num_gpus must not be provided").
# After `--`, head and worker pass the rest to `ray start` (e.g. --dashboard-port, --ray-client-server-port
# where several clusters share a host). Neither --block nor --pid-file: `ray start` returns and the node runs on as a daemon (end it with `ray stop`).
# `run` waits until N nodes are alive, then runs the command with ray.enabled=true ray.address=IP:PORT
# appended (the last value of a key wins, so these cannot be overridden by the command).
# Env: RAY (the ray executable, default `ray`), PYTHON (default `python3`), ASYNCRL_SECRET (passed on).
set -euo pipefail

RAY="${RAY:-ray}"
PYTHON="${PYTHON:-python3}"

die() { echo "start_cluster.sh: $*" >&2; exit 2; }

role="${1:-}"
[ -n "$role" ] || die "usage: start_cluster.sh head|worker|run|stop [options] (see the header of this file)"
shift

ip="" port="6379" address="" num_cpus="" num_gpus="" resources="" temp_dir="" block=0 pid_file=""
wait_nodes=1 wait_s=120
while [ $# -gt 0 ]; do
  case "$1" in
    --ip) ip="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --address) address="$2"; shift 2 ;;
    --num-cpus) num_cpus="$2"; shift 2 ;;
    --num-gpus) num_gpus="$2"; shift 2 ;;
    --resources) resources="$2"; shift 2 ;;
    --temp-dir) temp_dir="$2"; shift 2 ;;
    --block) block=1; shift ;;
    --pid-file) pid_file="$2"; shift 2 ;;
    --wait-nodes) wait_nodes="$2"; shift 2 ;;
    --wait-s) wait_s="$2"; shift 2 ;;
    --) shift; break ;;
    *) die "unknown option $1 for $role" ;;
  esac
done
[ "$block" = 1 ] && [ -n "$pid_file" ] && die "--block and --pid-file exclude each other"
extra=()
if [ "$role" = head ] || [ "$role" = worker ]; then extra=("$@"); fi
# Recent Ray (2.60 here) turns on token authentication for clusters it starts; every node and driver must
# carry the token: RAY_AUTH_TOKEN (or the file RAY_AUTH_TOKEN_PATH, default ~/.ray/auth_token)
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
# The token opens the whole cluster (jobs, objects, logs): what this script's nodes write (Ray's own token
# file when a head generates one, its session files) is this user's only, and a token file already there
# is made so.
umask 077
token_file="${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}"
if [ -f "$token_file" ]; then chmod 600 "$token_file"; fi

# `ray start` arguments common to head and worker nodes
node_args() {
  args=(--disable-usage-stats)
  [ -n "$ip" ] && args+=(--node-ip-address "$ip")
  [ -n "$num_cpus" ] && args+=(--num-cpus "$num_cpus")
  [ -n "$num_gpus" ] && args+=(--num-gpus "$num_gpus")
  [ -n "$resources" ] && args+=(--resources "$resources")
  args+=("${extra[@]}")
  return 0
}

# start the node described by "${args[@]}" in the mode chosen by --block / --pid-file
start_node() {
  if [ "$block" = 1 ]; then
    exec "$RAY" start "${args[@]}" --block
  elif [ -n "$pid_file" ]; then
    # its own session: the group id is the leader's pid, and killing the group ends gcs, raylet and workers
    setsid "$RAY" start "${args[@]}" --block >"$pid_file.log" 2>&1 < /dev/null &
    echo "$!" > "$pid_file"
    echo "${temp_dir:-$(default_temp_dir)}" > "$pid_file.temp_dir"  # where this node's ray_current_cluster is
  else
    "$RAY" start "${args[@]}"
  fi
}

# Ray's temp dir when --temp-dir is not given (ray._common.utils.get_default_ray_temp_dir)
default_temp_dir() { echo "${RAY_TMPDIR:-${TMPDIR:-/tmp}}/ray"; }

# remove $1/ray_current_cluster if the address it holds does not answer (a cluster that was stopped)
forget_dead_cluster() {
  local file="$1/ray_current_cluster" addr
  [ -f "$file" ] || return 0
  addr="$(cat "$file")"
  if ! timeout 2 bash -c "exec 3<>/dev/tcp/${addr%:*}/${addr##*:}" 2>/dev/null; then
    rm -f "$file"
  fi
}

# wait until the cluster at $address has $1 alive nodes (or fail after $wait_s seconds)
wait_for_nodes() {
  "$PYTHON" - "$address" "$1" "$wait_s" <<'PY'
import socket, sys, time
address, want, limit = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
deadline = time.monotonic() + limit
host, _, port = address.rpartition(":")
while True:  # ray.init would block for minutes on a head that is not up (or died): wait for its port first
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        break
    except OSError:
        if time.monotonic() > deadline:
            sys.exit(f"start_cluster.sh: no Ray head answers at {address} after {limit:g} s")
        time.sleep(0.5)
import ray
ray.init(address=address, log_to_driver=False)
while True:
    alive = sum(1 for n in ray.nodes() if n["Alive"])
    if alive >= want:
        print(f"start_cluster.sh: {alive} Ray nodes alive at {address}")
        break
    if time.monotonic() > deadline:
        sys.exit(f"start_cluster.sh: {alive} of {want} Ray nodes alive at {address} after {limit:g} s")
    time.sleep(1)
PY
}

case "$role" in
  head)
    node_args
    args+=(--head --port "$port" --include-dashboard=false)
    [ -n "$temp_dir" ] && args+=(--temp-dir "$temp_dir")
    start_node
    ;;
  worker)
    [ -n "$address" ] || die "worker needs --address HEAD_IP:PORT"
    node_args
    args+=(--address "$address")
    [ -n "$temp_dir" ] && args+=(--temp-dir "$temp_dir")
    start_node
    ;;
  run)
    [ -n "$address" ] || die "run needs --address HEAD_IP:PORT"
    [ $# -gt 0 ] || die "run needs a command after --, e.g. -- asyncrl train configs/demo.yaml"
    wait_for_nodes "$wait_nodes"
    exec "$@" ray.enabled=true "ray.address=$address"
    ;;
  stop)
    [ -n "$pid_file" ] || die "stop needs --pid-file FILE (written by head/worker --pid-file)"
    [ -f "$pid_file" ] || exit 0
    pgid="$(cat "$pid_file")"
    kill -TERM -- "-$pgid" 2>/dev/null || true
    for _ in $(seq 1 20); do
      # live members of the group (zombies left to a PID 1 that does not reap them do not count)
      ps -eo pgid=,stat= | awk -v g="$pgid" '$1 == g && $2 !~ /^Z/ { found = 1 } END { exit !found }' || break
      sleep 0.5
    done
    kill -KILL -- "-$pgid" 2>/dev/null || true
    for dir in "$(cat "$pid_file.temp_dir" 2>/dev/null || true)" "$(default_temp_dir)"; do
      [ -n "$dir" ] && forget_dead_cluster "$dir"
    done
    rm -f "$pid_file" "$pid_file.temp_dir"
    ;;
  *)
    die "unknown role $role (head, worker, run or stop)"
    ;;
esac
