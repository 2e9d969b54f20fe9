#!/bin/bash
# Start a real Slurm cluster on this machine for qgtrain's tests: slurmctld, and one slurmd per emulated
# node, each in its own network and UTS namespace (hostname nodeN, address 10.99.0.1N on a private bridge),
# so a rendezvous between nodes crosses a real network interface. Debian packages (slurmctld slurmd
# slurm-client munge), installed when missing. Root only. Idempotent: a cluster of this shape that is
# already up and idle is left as it is.
#
#   tests/cluster/start.sh [--nodes N] [--side M] [--cpus C] [--timeout S]
#
# The first N-M nodes form the default partition, `debug`; the last M (0 by default) a partition of
# their own, `side`, where jobs run only when they ask for it (sbatch --partition=side), so tests that
# take nodes down or throttle their links never touch them.
#
# State lives in $QGTRAIN_SLURM_LAB (default /tmp/qgtrain-slurm); the config is $LAB/slurm.conf, used
# through SLURM_CONF (the system's /etc/slurm is not touched). Every PID started is recorded in $LAB/run,
# and stop.sh stops exactly those. No accounting daemon: clients see a cluster without sacct, as many are.
set -euo pipefail
NODES=2; SIDE=0; CPUS=8; TIMEOUT=60
while [ $# -gt 0 ]; do
    case "$1" in
        --nodes) NODES=$2; shift 2 ;;
        --side) SIDE=$2; shift 2 ;;
        --cpus) CPUS=$2; shift 2 ;;
        --timeout) TIMEOUT=$2; shift 2 ;;
        *) echo "start.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
[ "$(id -u)" = 0 ] || { echo "start.sh: must run as root (it starts munged, slurmctld, slurmd)" >&2; exit 1; }
LAB=${QGTRAIN_SLURM_LAB:-/tmp/qgtrain-slurm}
HERE=$(cd "$(dirname "$0")" && pwd)
export SLURM_CONF=$LAB/slurm.conf
alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
idle() { [ "$(sinfo -h -o %T 2>/dev/null | sort -u | tr '\n' ' ')" = "idle " ]; }

[ "$SIDE" -lt "$NODES" ] || { echo "start.sh: --side $SIDE leaves no default partition" >&2; exit 2; }
SHAPE="nodes=$NODES side=$SIDE cpus=$CPUS"
if [ "$(cat "$LAB/run/shape" 2>/dev/null)" = "$SHAPE" ] && alive "$LAB/run/slurmctld.pid" && idle; then
    echo "cluster already up ($NODES nodes)"; exit 0
fi
[ -d "$LAB/run" ] && bash "$HERE/stop.sh" >&2

missing=""
for pkg in slurmctld slurmd slurm-client munge iproute2; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing="$missing $pkg"
done
if [ -n "$missing" ]; then
    export DEBIAN_FRONTEND=noninteractive
    # shellcheck disable=SC2086  # a list of package names
    apt-get install -y -q --no-install-recommends $missing >/dev/null \
        || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends $missing >/dev/null; }
fi

mkdir -p "$LAB"/{state,spool,log,run}
rm -rf "${LAB:?}"/state/* "${LAB:?}"/spool/*
echo "$SHAPE" > "$LAB/run/shape"

# munge: refuses to run as root; its key comes with the package
if [ ! -s /etc/munge/munge.key ]; then
    mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key && chmod 600 /etc/munge/munge.key
fi
install -d -o munge -g munge -m 0755 /run/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    runuser -u munge -- /usr/sbin/munged
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
    cp /run/munge/munged.pid "$LAB/run/munged.pid"
fi

# the nodes: a bridge in this namespace, one network + UTS namespace per node
HOST=$(hostname -s)
ip link show br-qgtrain >/dev/null 2>&1 || { ip link add br-qgtrain type bridge; ip addr add 10.99.0.1/24 dev br-qgtrain; }
ip link set br-qgtrain up
for i in $(seq "$NODES"); do
    ns=qgtrain-node$i
    if ! ip netns list | grep -qw "$ns"; then
        ip netns add "$ns"
        ip link add "veth-qg$i" type veth peer name eth0 netns "$ns"
        ip link set "veth-qg$i" master br-qgtrain up
        ip -n "$ns" addr add "10.99.0.$((10 + i))/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
    fi
    mkdir -p "$LAB/hosts"
    { echo "127.0.0.1 localhost"; echo "10.99.0.1 $HOST"
      for j in $(seq "$NODES"); do echo "10.99.0.$((10 + j)) node$j"; done; } > "$LAB/hosts/node$i"
done

FIRST_JOB_ID=$(( $(date +%s) / 4 % 50000000 + 1000 ))  # never reuse an earlier run's job ids
MEM=$(( $(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p') / NODES ))
{
cat <<CONF
ClusterName=qgtrain
FirstJobId=$FIRST_JOB_ID
SlurmctldHost=$HOST(10.99.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# a requeued job may start again cred_expire+1 s later (default 120 s; 5 is the minimum)
AuthInfo=cred_expire=5
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$LAB/state
SlurmdSpoolDir=$LAB/spool/%n
SlurmctldPidFile=$LAB/run/slurmctld.pid
SlurmdPidFile=$LAB/run/slurmd-%n.pid
SlurmctldLogFile=$LAB/log/slurmctld.log
SlurmdLogFile=$LAB/log/slurmd-%n.log
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# lets each node advertise more CPUs than the machine has, so several tasks fit side by side
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2
MpiDefault=none
SwitchType=switch/none
JobRequeue=1
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
# finished jobs stay visible to squeue and scontrol for an hour: state without accounting
MinJobAge=3600
KillWait=5
Waittime=0
OverTimeLimit=0
CONF
for i in $(seq "$NODES"); do
    echo "NodeName=node$i NodeAddr=10.99.0.$((10 + i)) NodeHostname=node$i CPUs=$CPUS RealMemory=$MEM State=UNKNOWN"
done
echo "PartitionName=debug Nodes=node[1-$((NODES - SIDE))] Default=YES MaxTime=INFINITE State=UP"
if [ "$SIDE" -gt 0 ]; then
    echo "PartitionName=side Nodes=node[$((NODES - SIDE + 1))-$NODES] MaxTime=INFINITE State=UP"
fi
} > "$SLURM_CONF"

slurmctld -f "$SLURM_CONF"
for _ in $(seq 50); do [ -s "$LAB/run/slurmctld.pid" ] && break; sleep 0.1; done
for i in $(seq "$NODES"); do
    mkdir -p "$LAB/spool/node$i"
    # nsenter keeps /sys/fs/cgroup, which slurmd needs (`ip netns exec` remounts /sys and slurmd fails)
    nsenter --net="/run/netns/qgtrain-node$i" unshare --uts --mount --propagation private \
        sh -c "mount --bind $LAB/hosts/node$i /etc/hosts && hostname node$i && exec slurmd -f $SLURM_CONF -N node$i"
done

deadline=$(( $(date +%s) + TIMEOUT ))
until idle; do
    if [ "$(date +%s)" -ge "$deadline" ]; then
        echo "start.sh: nodes not idle after ${TIMEOUT}s; logs in $LAB/log" >&2
        sinfo -N -o "%N %T %E" >&2 || true
        exit 1
    fi
    sleep 0.2
done
echo "cluster up: $NODES nodes, SLURM_CONF=$SLURM_CONF"
