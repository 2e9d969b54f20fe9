"""The srun steps of a batch job: on how many of the allocation's nodes each runs, and the shell
loop that runs them until the run finishes, stops at a checkpoint or fails for good.

Shared by the rendered batch script (sbatch.py) and submitit's job script (submitit_params.py, as
a shell function its srun line calls), so a failed step comes back the same way under either. The
loop decides nothing itself: `qgtrain recover` reads what the step left and answers. No torch here.
"""

from __future__ import annotations

from ..config import SlurmConfig
from ..foundation.errors import EXIT_REQUEUE_ME, EXIT_STOPPED


def tasks_per_node(slurm: SlurmConfig) -> int:
    return slurm.gpus_per_node or slurm.tasks_per_node or 1


def step_options(slurm: SlurmConfig) -> str:
    """srun's options for a step on slurm.nodes of an allocation that holds spares too (none
    without spares: a step takes the whole allocation, as `sbatch --nodes` may have resized it)."""
    if not slurm.spare_nodes:
        return ""
    return f"--nodes={slurm.nodes} --ntasks={slurm.nodes * tasks_per_node(slurm)} "


def retry_steps(slurm: SlurmConfig) -> str:
    """`run_steps SRUN_ARGS...`: run srun steps until the run finishes, stops at a checkpoint, or
    fails for good.

    A rank that dies takes its step down at once (srun --kill-on-bad-exit, in the arguments);
    srun's report of which task failed, where and how is kept for `qgtrain recover` (run by
    $RECOVER_PYTHON with the arguments in recover_args), whose answer is carried out: another step
    here, a requeue (away from a node that keeps failing), or the end. With slurm.spare_nodes a
    retry may name the node the failure points at, and every later step leaves it out (srun
    --exclude) while a spare is left to take its place. The step's exit code is returned."""
    spares, max_restarts = slurm.spare_nodes, slurm.max_restarts
    # the step's ranks: with spares, fewer than the allocation's
    count = str(slurm.nodes * tasks_per_node(slurm)) if spares else '"${SLURM_NTASKS:-1}"'
    return f"""run_steps() {{
    local said attempt=0 status decision action exclude away=
    local job="${{SLURM_ARRAY_JOB_ID:-${{SLURM_JOB_ID:-}}}}"
    job=$job${{SLURM_ARRAY_TASK_ID:+_$SLURM_ARRAY_TASK_ID}}
    said=$(mktemp)
    while true; do
        {{ command srun ${{away:+"--exclude=$away"}} "$@" 2>&1 1>&3 3>&- \\
            | (trap '' TERM HUP USR1 USR2; exec tee "$said" >&2); }} 3>&1
        status=${{PIPESTATUS[0]}}
        case "$status" in
            # finished, or stopped at a checkpoint (and requeued by rank 0)
            0|{EXIT_STOPPED}) break ;;
            # stopped at a checkpoint, but the ranks could not requeue (no scontrol there)
            {EXIT_REQUEUE_ME})
                [ "${{SLURM_RESTART_COUNT:-0}}" -lt {max_restarts} ] && scontrol requeue "$job"
                break ;;
        esac
        decision=$("$RECOVER_PYTHON" -m qgtrain recover "${{recover_args[@]}}" \\
            --exit-code "$status" --attempt "$attempt" --srun-log "$said" \\
            --restart "${{SLURM_RESTART_COUNT:-0}}" --spare-nodes {spares} --away "$away" \\
            --ranks {count} --partition "${{SLURM_JOB_PARTITION:-}}") || break
        read -r action exclude <<< "$decision"
        if [ "$action" = retry ]; then
            attempt=$((attempt + 1))
            if [ -n "$exclude" ]; then away=${{away:+$away,}}$exclude; fi
            sleep $((2 * attempt))
        elif [ "$action" = requeue ] && [ -n "$exclude" ]; then
            trap '' TERM  # requeueing ends this script; finish the three calls first
            scontrol requeuehold "$job" && scontrol update JobId="$job" ExcNodeList="$exclude"
            scontrol release "$job"
            break
        elif [ "$action" = requeue ]; then
            scontrol requeue "$job"
            break
        else
            break
        fi
    done
    rm -f "$said"
    return "$status"
}}"""
