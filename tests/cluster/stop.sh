#!/bin/bash
# Stop what start.sh started, by the PIDs it recorded (never by process name), and remove its namespaces
# and bridge. Jobs still running are cancelled first, while slurmd can still end them.
set -uo pipefail
LAB=${QGTRAIN_SLURM_LAB:-/tmp/qgtrain-slurm}
export SLURM_CONF=$LAB/slurm.conf

# stop_pids COMMAND FILE...: SIGTERM to each PID at once (only if it still runs COMMAND), then
# SIGKILL to any left after 10 s
stop_pids() {
    local command=$1 file pid pids=()
    shift
    for file in "$@"; do
        [ -s "$file" ] || continue
        pid=$(cat "$file")
        if [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$command" ]; then
            kill "$pid" && pids+=("$pid")
        fi
        rm -f "$file"
    done
    # each daemon takes about 2 s to exit: waited for together, not one after another
    for _ in $(seq 100); do
        local running=0
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && running=1; done
        [ "$running" = 0 ] && break
        sleep 0.1
    done
    for pid in "${pids[@]}"; do
        kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
        echo "stopped $command ($pid)"
    done
}

if [ -s "$LAB/run/slurmctld.pid" ] && kill -0 "$(cat "$LAB/run/slurmctld.pid")" 2>/dev/null; then
    timeout 10 scancel --quiet --user=root 2>/dev/null || true
    for _ in $(seq 40); do
        [ -z "$(timeout 5 squeue -h -t PD,R,CG,S,RQ,RS,RF,RH,SE -o %i 2>/dev/null)" ] && break
        sleep 0.25
    done
fi
stop_pids slurmd "$LAB"/run/slurmd-*.pid
stop_pids slurmctld "$LAB/run/slurmctld.pid"
stop_pids munged "$LAB/run/munged.pid"
for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep '^qgtrain-node[0-9]*$'); do
    # a job step that lost its node (slurmstepd, its tasks) would keep the namespace and its link alive
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null
    ip netns del "$ns"
done
for link in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep '^veth-qg[0-9]*$'); do
    ip link del "$link" 2>/dev/null
done
ip link show br-qgtrain >/dev/null 2>&1 && ip link del br-qgtrain
rm -f "$LAB/run/shape"
exit 0
