#!/usr/bin/env bash
# A real Slurm on one machine whose nodes look like separate machines: each slurmd runs in its own
# network namespace (its own address on a private bridge), with its own hostname and an /etc/hosts
# naming every node; jobs are submitted from a separate "login" namespace the same way. A rank that
# binds to loopback, or a driver that hands out 127.0.0.1, fails here as it would across machines.
#
#   testcluster.sh up STATE_DIR [--nodes N] [--cpus C]   start munged, slurmctld and N slurmd (default 4 x 8 CPUs)
#   testcluster.sh login STATE_DIR [--] CMD ARGS...      run CMD on the login host (exit status passed through)
#   testcluster.sh node STATE_DIR K [--] CMD ARGS...     run CMD on node K
#   testcluster.sh env STATE_DIR                         print `export` lines (SLURM_CONF, ...)
#   testcluster.sh down STATE_DIR [--keep-logs]          cancel every job, stop the daemons, remove the
#                                                        namespaces, links and files this script created
#
# Everything lives in STATE_DIR (config, spool, state, logs, munge key and socket, pid files, the
# hosts file) and the names of what was created outside it (namespaces, bridge, veth pairs) are
# recorded there, so `down` removes exactly those. Needs root, iproute2, util-linux, and Debian's
# slurmctld, slurmd, slurm-client and munge (scripts/setup.sh). Facts behind the choices:
# ../shared/notes/test-infrastructure.md (multiple slurmd on one machine, CPUs=8 + config_overrides
# for oversubscription, no cgroups: proctrack/linuxproc and task/none, munged's own paths).
set -euo pipefail

die() {
  echo "testcluster: $*" >&2
  exit 1
}
[[ $# -ge 2 ]] || die "usage: $0 up|down|login|node|env STATE_DIR ..."
cmd=$1
state=$2
shift 2
mkdir -p "$state"
state=$(cd "$state" && pwd)
names=$state/names # shell assignments: suffix, subnet, bridge, namespaces, nodes, port

in_ns() { # in_ns NAMESPACE HOSTNAME CMD ARGS...: a process with that network, hostname and /etc/hosts
  local ns=$1 host=$2
  shift 2
  exec nsenter --net="/run/netns/$ns" unshare --uts --mount --propagation private \
    bash -c 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"' megascale-ns "$host" "$state/hosts" "$@"
}

case $cmd in
up)
  nodes=4 cpus=8
  while [[ $# -gt 0 ]]; do
    case $1 in
    --nodes) nodes=$2; shift 2 ;;
    --cpus) cpus=$2; shift 2 ;;
    *) die "up: unknown option $1" ;;
    esac
  done
  [[ ! -e $names ]] || die "$state already holds a cluster (run down first)"
  [[ $(id -u) -eq 0 ]] || die "needs root (network namespaces, bind mounts)"
  for tool in slurmctld slurmd sinfo munged mungekey ip nsenter unshare; do
    command -v $tool >/dev/null || die "$tool not found: run scripts/setup.sh"
  done
  t0=$(date +%s%N)
  suffix=$(printf '%04x' $((RANDOM % 65536)))
  subnet=10.77.$((RANDOM % 200 + 20))
  port=$((20000 + RANDOM % 20000))
  bridge=msbr$suffix
  namespaces=""
  for ((k = 0; k < nodes; k++)); do namespaces+=" ms$suffix-node$k"; done
  namespaces+=" ms$suffix-login"
  cat >"$names" <<EOF
suffix=$suffix
subnet=$subnet
port=$port
bridge=$bridge
nodes=$nodes
namespaces="${namespaces# }"
EOF
  mkdir -p "$state"/{log,spool,ctld,munge}
  chmod 0755 "$state" "$state/munge"
  # The network: a bridge with the controller's address, one namespace per node and the login host.
  ip link add "$bridge" type bridge
  ip addr add "$subnet.254/24" dev "$bridge"
  ip link set "$bridge" up
  i=0
  for ns in $namespaces; do
    if [[ $ns == *-login ]]; then addr=$subnet.200; else addr=$subnet.$((i + 1)); i=$((i + 1)); fi
    ip netns add "$ns"
    ip link add "v$suffix${ns##*-}" type veth peer name "p$suffix${ns##*-}"
    ip link set "p$suffix${ns##*-}" netns "$ns"
    ip -n "$ns" link set "p$suffix${ns##*-}" name eth0
    ip -n "$ns" addr add "$addr/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
    ip link set "v$suffix${ns##*-}" master "$bridge" up
  done
  ctl=$(hostname)
  {
    echo "127.0.0.1 localhost"
    echo "$subnet.254 $ctl"
    for ((k = 0; k < nodes; k++)); do echo "$subnet.$((k + 1)) node$k"; done
    echo "$subnet.200 login"
  } >"$state/hosts"
  # munge: its own key, socket, pid, log and seed files.
  mungekey -c -k "$state/munge/munge.key" 2>/dev/null
  chmod 0600 "$state/munge/munge.key"
  munged --key-file="$state/munge/munge.key" --socket="$state/munge/socket" --pid-file="$state/munge/munged.pid" \
    --log-file="$state/log/munged.log" --seed-file="$state/munge/munged.seed" --force
  conf=$state/slurm.conf
  cat >"$conf" <<EOF
ClusterName=megascale-test
SlurmctldHost=$ctl($subnet.254)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$state/munge/socket
CredType=cred/munge
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/spool/%n
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd-%n.pid
SlurmctldLogFile=$state/log/slurmctld.log
SlurmdLogFile=$state/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
MessageTimeout=5
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=2
MailProg=/bin/true
EOF
  for ((k = 0; k < nodes; k++)); do
    echo "NodeName=node$k NodeHostname=node$k NodeAddr=$subnet.$((k + 1)) CPUs=$cpus State=UNKNOWN" >>"$conf"
  done
  echo "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >>"$conf"
  export SLURM_CONF=$conf
  slurmctld -f "$conf" # daemonizes; pid file in $state
  for ((k = 0; k < nodes; k++)); do
    mkdir -p "$state/spool/node$k"
    (in_ns "ms$suffix-node$k" "node$k" slurmd -f "$conf" -N "node$k") </dev/null >"$state/log/slurmd-node$k.out" 2>&1
  done
  deadline=$(($(date +%s) + 30))
  while :; do
    idle=$(sinfo -h -o '%T %D' 2>/dev/null | awk '$1 == "idle" {print $2}')
    [[ ${idle:-0} -eq $nodes ]] && break
    if [[ $(date +%s) -gt $deadline ]]; then
      sinfo -N 2>&1 || true
      tail -n 20 "$state"/log/* >&2 || true
      die "the $nodes nodes did not come up idle within 30 s (logs above; run down)"
    fi
    sleep 0.2
  done
  echo "testcluster: $nodes nodes up in $((($(date +%s%N) - t0) / 1000000)) ms (controller $subnet.254," \
    "nodes $subnet.1-$nodes, login $subnet.200, state $state)"
  ;;

login | node)
  [[ -e $names ]] || die "no cluster in $state"
  # shellcheck disable=SC1090
  source "$names"
  if [[ $cmd == login ]]; then
    ns=ms$suffix-login host=login
  else
    [[ $# -ge 1 ]] || die "node: which node?"
    ns=ms$suffix-node$1 host=node$1
    shift
  fi
  [[ ${1:-} == -- ]] && shift
  [[ $# -ge 1 ]] || die "$cmd: no command"
  export SLURM_CONF=$state/slurm.conf
  in_ns "$ns" "$host" "$@"
  ;;

env)
  echo "export SLURM_CONF=$state/slurm.conf"
  ;;

down)
  [[ ${1:-} == --keep-logs ]] && keep_logs=1 || keep_logs=0
  if [[ -e $names ]]; then
    # shellcheck disable=SC1090
    source "$names"
    export SLURM_CONF=$state/slurm.conf
    # Jobs first: their steps run under slurmstepd, which outlives the daemons.
    if [[ -e $state/slurmctld.pid ]] && kill -0 "$(cat "$state/slurmctld.pid")" 2>/dev/null; then
      ids=$(squeue -h -o %i 2>/dev/null || true)
      [[ -n $ids ]] && scancel $ids 2>/dev/null || true
      for _ in $(seq 100); do
        [[ -z $(squeue -h -o %i 2>/dev/null || true) ]] && break
        sleep 0.1
      done
    fi
    stop() { # stop PIDFILE: SIGTERM, then SIGKILL after 3 s
      [[ -e $1 ]] || return 0
      local pid
      pid=$(cat "$1")
      kill "$pid" 2>/dev/null || return 0
      for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
      kill -9 "$pid" 2>/dev/null || true
    }
    for ((k = 0; k < nodes; k++)); do stop "$state/slurmd-node$k.pid"; done
    stop "$state/slurmctld.pid"
    stop "$state/munge/munged.pid"
    for ns in $namespaces; do
      if [[ -e /run/netns/$ns ]]; then
        pids=$(ip netns pids "$ns" 2>/dev/null || true)
        [[ -n $pids ]] && kill -9 $pids 2>/dev/null || true
        ip netns delete "$ns"
      fi
      ip link delete "v$suffix${ns##*-}" 2>/dev/null || true
    done
    ip link delete "$bridge" 2>/dev/null || true
  fi
  rm -rf "$state"/{names,slurm.conf,hosts,spool,ctld,munge} "$state"/*.pid
  [[ $keep_logs -eq 1 ]] || rm -rf "$state/log"
  rmdir "$state" 2>/dev/null || true
  ;;

*) die "unknown command $cmd (up, down, login, node, env)" ;;
esac
