#!/usr/bin/env bash
# A real, small Slurm on one machine whose nodes look like separate machines.
#
#   testcluster.sh up STATE_DIR [--nodes N] [--cpus C]   start it: N nodes (default 4) of C CPUs each (default 8,
#                                                        oversubscribing the real cores); waits until all are idle
#   testcluster.sh login STATE_DIR [--] CMD ARGS...      run CMD on the login host; exit status passed through
#   testcluster.sh node STATE_DIR K [--] CMD ARGS...     run CMD on node K
#   testcluster.sh env STATE_DIR                         print `export` lines (SLURM_CONF, ...) for `eval`
#   testcluster.sh down STATE_DIR [--keep-logs]          cancel every job, stop the daemons, kill whatever still
#                                                        runs in the namespaces, delete namespaces, links, files
# For example:
#   tests/slurm/testcluster.sh up /tmp/c
#   tests/slurm/testcluster.sh login /tmp/c srun -N4 --ntasks-per-node=2 bash -c 'echo $(hostname) $(hostname -I)'
#   eval "$(tests/slurm/testcluster.sh env /tmp/c)"; squeue      # client commands also work from here
#   tests/slurm/testcluster.sh down /tmp/c
#
# What `up` builds (as root; XXXX is a random suffix and S a free subnet, so several clusters can coexist):
#   - a bridge msbrXXXX in the root namespace with the controller's address 10.77.S.254/24;
#   - network namespaces msXXXX-node0 .. msXXXX-node{N-1} (10.77.S.1 ..) and msXXXX-login (10.77.S.200), each
#     with `lo` and an `eth0` that is one end of a veth pair (vXXXXnodeK, vXXXXlogin) plugged into the bridge;
#   - munged and slurmctld in the root namespace, one slurmd per node namespace. A process "on" a host has that
#     namespace's network, its own hostname (nodeK, login) and a generated /etc/hosts naming every host,
#     bind-mounted in a private mount namespace; the file system and the current directory are shared. Job
#     steps inherit all of it from slurmd. Client commands need SLURM_CONF (`login` and `node` set it).
#
# Everything lives in STATE_DIR: slurm.conf, hosts, munge/ (key, socket, pid, seed), spool/, ctld/ (state),
# *.pid, log/ (daemon logs), and `names`, which records what `up` created outside it (namespaces, veths,
# bridge) before creating it, so that `down` deletes exactly those. `down` is idempotent and safe after a
# failed `up`. Needs Debian's slurmctld slurmd slurm-client munge iproute2 (and util-linux). See README.md.
# shellcheck disable=SC1090,SC2015,SC2016,SC2086 # sourced state file, A && B || die, word-split pid lists
set -euo pipefail

die() {
  echo "testcluster: $*" >&2
  exit 1
}
[[ $# -ge 2 ]] || die "usage: testcluster.sh up|down|login|node|env STATE_DIR ... (see the top of $0)"
cmd=$1
state=$(realpath -m -- "$2")
shift 2
names=$state/names

# in_ns NETNS HOSTNAME CMD ARGS...: become CMD on that host (network namespace, hostname, /etc/hosts).
# Not `ip netns exec`: it remounts /sys, the cgroup mounts vanish from under it and slurmd exits.
in_ns() {
  local ns=$1 host=$2
  shift 2
  exec nsenter --net="/run/netns/$ns" unshare --uts --mount --propagation private \
    bash -c 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"' testcluster "$host" "$state/hosts" "$@"
}

# ours PID: the process is one of this cluster's daemons (its command line names STATE_DIR).
ours() { [[ -r /proc/$1/cmdline ]] && tr '\0' ' ' <"/proc/$1/cmdline" | grep -qF -- "$state/"; }

# stop PID...: SIGTERM, then SIGKILL what is still alive after 5 s.
stop() {
  [[ $# -gt 0 ]] || return 0
  kill "$@" 2>/dev/null || true
  for _ in {1..50}; do
    kill -0 "$@" 2>/dev/null || return 0 # (true while any of them lives)
    sleep 0.1
  done
  kill -9 "$@" 2>/dev/null || true
}

case $cmd in
up)
  nodes=4 cpus=8
  while [[ $# -gt 0 ]]; do
    case $1 in
    --nodes) nodes=${2:-}; shift 2 || shift ;;
    --cpus) cpus=${2:-}; shift 2 || shift ;;
    *) die "up: unknown option $1" ;;
    esac
  done
  [[ $nodes =~ ^[0-9]+$ ]] && ((nodes >= 1 && nodes <= 199)) || die "up: --nodes must be 1..199"
  [[ $cpus =~ ^[0-9]+$ ]] && ((cpus >= 1)) || die "up: --cpus must be a positive number"
  [[ $EUID -eq 0 ]] || die "up needs root (network namespaces, bind mounts)"
  for tool in munged mungekey slurmctld slurmd sinfo ip ss nsenter unshare flock; do
    command -v $tool >/dev/null || die "$tool not found (apt-get install slurmctld slurmd slurm-client munge iproute2)"
  done
  [[ $state != *[[:space:]]* ]] || die "STATE_DIR must not contain white space (slurm.conf cannot quote it)"
  # Unix sockets (munge's, slurmstepd's spool/nodeK/nodeK_JOB.STEP) must fit in 108 bytes.
  [[ ${#state} -le 64 ]] || die "STATE_DIR is too long (${#state} > 64 characters): $state"
  [[ ! -e $names ]] || die "$state already holds a cluster (run: $0 down $state)"
  logs() { find "$state/log" -type f -size +0 -exec tail -n 15 {} + >&2 2>/dev/null || true; }
  trap 'logs; echo "testcluster: up failed (line $LINENO, logs above); clean up with: $0 down $state" >&2' ERR
  t0=${EPOCHREALTIME//[!0-9]/} # microseconds
  mkdir -p "$state"/{log,spool,ctld,munge}
  chmod 0755 "$state" "$state/munge" # munged wants a root-owned directory nobody else can write

  # Names, subnet and controller port, chosen under a lock so that two `up`s cannot pick the same ones: a
  # subnet no interface uses yet, and a port derived from it that nothing listens on (slurmctld listens in
  # the root namespace; each slurmd on port+1 in its own).
  exec {lock}>/run/lock/megascale-testcluster.lock
  flock "$lock"
  used=$(ip -o -4 addr show)
  while :; do
    suffix=$(od -An -N2 -tx2 /dev/urandom | tr -d ' ')
    [[ ! -e /run/netns/ms$suffix-login ]] && ! ip link show "msbr$suffix" &>/dev/null && break
  done
  x0=$((RANDOM % 256))
  for ((i = 0; ; i++)); do
    ((i < 256)) || die "no free subnet 10.77.0-255.0/24"
    x=$(((x0 + i) % 256)) && subnet=10.77.$x port=$((20000 + 2 * x))
    grep -qF "inet $subnet." <<<"$used" || [[ -n $(ss -Hltn "sport = :$port") ]] || break
  done
  bridge=msbr$suffix
  namespaces="" veths=""
  for ((k = 0; k < nodes; k++)); do namespaces+=" ms$suffix-node$k" veths+=" v${suffix}node$k"; done
  namespaces+=" ms$suffix-login" veths+=" v${suffix}login"
  cat >"$names" <<EOF
suffix=$suffix
subnet=$subnet
port=$port
nodes=$nodes
bridge=$bridge
namespaces="${namespaces# }"
veths="${veths# }"
EOF

  # The network: the bridge with the controller's address, then one namespace + veth pair per host.
  ip link add "$bridge" type bridge
  ip addr add "$subnet.254/24" dev "$bridge"
  ip link set "$bridge" up
  exec {lock}>&- # the subnet is taken (and the daemons must not inherit the lock)
  read -ra nss <<<"$namespaces"
  read -ra vs <<<"$veths"
  for i in "${!nss[@]}"; do
    ns=${nss[i]} addr=$subnet.$((i + 1))
    [[ $ns == *-login ]] && addr=$subnet.200
    ip netns add "$ns"
    ip link add "${vs[i]}" type veth peer name eth0 netns "$ns"
    ip link set "${vs[i]}" master "$bridge" up
    ip -n "$ns" addr add "$addr/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
  done
  ctl=$(hostname) # slurmctld only runs where `hostname` matches SlurmctldHost
  {
    echo "127.0.0.1 localhost"
    echo "::1 localhost ip6-localhost ip6-loopback"
    echo "$subnet.254 $ctl"
    for ((k = 0; k < nodes; k++)); do echo "$subnet.$((k + 1)) node$k"; done
    echo "$subnet.200 login"
  } >"$state/hosts"

  # munge: its own key, socket, pid, log and seed (it refuses Debian's defaults when run by hand as root).
  mungekey -c -k "$state/munge/munge.key"
  munged --key-file="$state/munge/munge.key" --socket="$state/munge/socket" --pid-file="$state/munge/munged.pid" \
    --log-file="$state/log/munged.log" --seed-file="$state/munge/munged.seed" --force </dev/null >>"$state/log/munged.out" 2>&1

  # No cgroups, no systemd, no accounting. CPUs=$cpus with config_overrides lets 8 tasks run on 2 real cores
  # (without config_overrides such a node is INVALID); more tasks than CPUs need `srun -O`. Short timeouts
  # make failures fast; ReturnToService=2 brings a node that went DOWN back as soon as its slurmd registers.
  conf=$state/slurm.conf
  cat >"$conf" <<EOF
ClusterName=testcluster
SlurmctldHost=$ctl($subnet.254)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$state/munge/socket
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
SchedulerParameters=batch_sched_delay=0
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MessageTimeout=5
SlurmdTimeout=30
KillWait=5
InactiveLimit=0
MinJobAge=2
MailProg=/bin/true
EOF
  for ((k = 0; k < nodes; k++)); do
    echo "NodeName=node$k NodeHostname=node$k NodeAddr=$subnet.$((k + 1)) CPUs=$cpus State=UNKNOWN" >>"$conf"
  done
  echo "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >>"$conf"

  # The daemons fork into the background themselves and write their pid files; never on a pipe of ours.
  slurmctld -f "$conf" </dev/null >>"$state/log/slurmctld.out" 2>&1
  starters=()
  for ((k = 0; k < nodes; k++)); do
    mkdir -p "$state/spool/node$k"
    (in_ns "ms$suffix-node$k" "node$k" slurmd -f "$conf" -N "node$k") </dev/null >>"$state/log/slurmd-node$k.out" 2>&1 &
    starters+=($!)
  done
  for pid in "${starters[@]}"; do wait "$pid"; done

  export SLURM_CONF=$conf
  deadline=$((SECONDS + 30))
  until [[ $(sinfo -h -t idle -o %D 2>/dev/null) == "$nodes" ]]; do
    if ((SECONDS > deadline)); then
      sinfo -N -l >&2 || true
      logs
      die "the $nodes nodes were not idle within 30 s (logs above); clean up with: $0 down $state"
    fi
    sleep 0.1
  done
  ms=$(((${EPOCHREALTIME//[!0-9]/} - t0) / 1000))
  echo "testcluster: $nodes nodes up in $((ms / 1000)).$(printf %03d $((ms % 1000))) s: controller $ctl" \
    "($subnet.254), node0..node$((nodes - 1)) = $subnet.1-$nodes, login = $subnet.200, state $state"
  ;;

login | node)
  [[ -e $names ]] || die "no cluster in $state (run: $0 up $state)"
  source "$names"
  if [[ $cmd == login ]]; then
    ns=ms$suffix-login host=login
  else
    k=${1:-}
    [[ $k =~ ^[0-9]+$ ]] && ((k < nodes)) || die "node: K must be 0..$((nodes - 1))"
    shift
    ns=ms$suffix-node$k host=node$k
  fi
  [[ ${1:-} == -- ]] && shift
  [[ $# -ge 1 ]] || die "$cmd: no command given"
  export SLURM_CONF=$state/slurm.conf
  in_ns "$ns" "$host" "$@"
  ;;

env)
  [[ -e $names ]] || die "no cluster in $state (run: $0 up $state)"
  source "$names"
  printf 'export SLURM_CONF=%q\n' "$state/slurm.conf"
  printf 'export TESTCLUSTER_STATE=%q TESTCLUSTER_NODES=%d TESTCLUSTER_SUBNET=%s\n' "$state" "$nodes" "$subnet"
  ;;

down)
  keep_logs=0
  for a in "$@"; do
    [[ $a == --keep-logs ]] && keep_logs=1 || die "down: unknown option $a"
  done
  [[ -d $state ]] || exit 0
  if [[ -e $names ]]; then
    source "$names"
    export SLURM_CONF=$state/slurm.conf
    # Jobs first: steps run under slurmstepd, which is not slurmd's child and outlives it.
    ctld=$(cat "$state/slurmctld.pid" 2>/dev/null || true)
    if [[ -n $ctld ]] && ours "$ctld"; then
      jobs=$(squeue -h -o %A 2>/dev/null || true)
      if [[ -n $jobs ]]; then
        scancel $jobs 2>/dev/null || true
        deadline=$((SECONDS + 15)) # KillWait=5: ample
        while [[ -n $(squeue -h -o %A 2>/dev/null || true) ]] && ((SECONDS < deadline)); do sleep 0.1; done
      fi
    fi
    # The daemons, by their pid files (checked to be ours: a stale pid may have been reused), all at once (each
    # takes ~2 s to exit; none needs another to do so), and slurmctld's helper slurmscriptd, in case slurmctld
    # has to be killed and cannot stop it.
    daemons=()
    for f in "$state"/slurmd-*.pid "$state/slurmctld.pid" "$state/munge/munged.pid"; do
      pid=$(cat "$f" 2>/dev/null || true)
      [[ -n $pid ]] && ours "$pid" && daemons+=("$pid")
    done
    helpers=$([[ -n $ctld ]] && ours "$ctld" && pgrep -P "$ctld" || true)
    stop "${daemons[@]}"
    [[ -z $helpers ]] || kill -9 $helpers 2>/dev/null || true
    # Whatever still runs on a host (a step's stray child, a `login` command), then the namespaces; deleting
    # one destroys its veth pair, but asynchronously: wait for the links to go before removing the bridge.
    for ns in $namespaces; do
      [[ -e /run/netns/$ns ]] || continue
      for _ in {1..50}; do
        pids=$(ip netns pids "$ns" 2>/dev/null || true)
        [[ -z $pids ]] && break
        kill -9 $pids 2>/dev/null || true
        sleep 0.1
      done
      ip netns delete "$ns" || true
    done
    for v in $veths; do
      for _ in {1..50}; do
        ip link show "$v" &>/dev/null || break
        ip link delete "$v" 2>/dev/null || true
        sleep 0.1
      done
    done
    ! ip link show "$bridge" &>/dev/null || ip link delete "$bridge" || true
    # Keep the record (a second `down` retries) unless all is gone.
    left=""
    for pid in "${daemons[@]}"; do kill -0 "$pid" 2>/dev/null && left+=" pid:$pid"; done
    for ns in $namespaces; do [[ ! -e /run/netns/$ns ]] || left+=" netns:$ns"; done
    for l in $veths $bridge; do ! ip link show "$l" &>/dev/null || left+=" link:$l"; done
    [[ -z $left ]] || die "down: could not remove$left"
  fi
  rm -rf "$state"/{names,slurm.conf,hosts,spool,ctld,munge} "$state"/*.pid
  [[ $keep_logs -eq 1 ]] || rm -rf "$state/log"
  rmdir "$state" 2>/dev/null || true
  ;;

*) die "unknown command $cmd (up, down, login, node, env)" ;;
esac
