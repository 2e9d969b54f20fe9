"""The srun steps of a batch job: on how many of the allocation's nodes each runs, and the shell
loop that runs them until the run finishes, stops at a checkpoint or fails for good.

Shared by the rendered batch script (sbatch.py) and submitit's job script (submitit_params.py, as
a shell function its srun line calls), so a failed step comes back the same way under either. The
loop decides nothing itself: `qgtrain recover` reads what the step left and answers. No torch here.
"""

from __future__ import annotations

from ..config import SlurmConfig
from ..config.slurm import ranks_per_node, shrinks
from ..foundation.errors import EXIT_REQUEUE_ME, EXIT_STOPPED


def shapes_steps(slurm: SlurmConfig) -> bool:
    """Whether each step names its nodes and tasks: with spares (a step runs on part of the
    allocation) or slurm.min_nodes (on fewer nodes after a failure). Otherwise a step takes the
    whole allocation, as `sbatch --nodes` may have resized it."""
    return bool(slurm.spare_nodes) or shrinks(slurm)


def retry_steps(slurm: SlurmConfig) -> str:
    """`run_steps SRUN_ARGS...`: run srun steps until the run finishes, stops at a checkpoint, or
    fails for good.

    A rank that dies takes its step down at once (srun --kill-on-bad-exit, in the arguments);
    srun's report of which task failed, where and how is kept for `qgtrain recover` (run by
    $RECOVER_PYTHON with the arguments in recover_args), whose answer is carried out: another step
    here, a requeue (away from a node that keeps failing), or the end. A retry may name the node
    the failure points at, and every later step leaves it out (srun --exclude): on a spare
    (slurm.spare_nodes), or, with none left, on the fewer nodes the answer names
    (slurm.min_nodes). The step's exit code is returned."""
    spares, max_restarts = slurm.spare_nodes, slurm.max_restarts
    shape, local, step, answer, fewer = _shaped(slurm)
    return f"""run_steps() {{
    local said attempt=0 status decision {answer} away={local}
    local job="${{SLURM_ARRAY_JOB_ID:-${{SLURM_JOB_ID:-}}}}"
    job=$job${{SLURM_ARRAY_TASK_ID:+_$SLURM_ARRAY_TASK_ID}}
    said=$(mktemp)
    while true; do
        {{ command srun ${{away:+"--exclude=$away"}} {shape}"$@" 2>&1 1>&3 3>&- \\
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
            {step} --partition "${{SLURM_JOB_PARTITION:-}}") || break
        read -r {answer} <<< "$decision"
        if [ "$action" = retry ]; then
            attempt=$((attempt + 1))
            if [ -n "$exclude" ]; then away=${{away:+$away,}}$exclude; fi{fewer}
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


def _shaped(slurm: SlurmConfig) -> tuple[str, str, str, str, str]:
    """The loop's parts that name each step's nodes and tasks, where steps are shaped: srun's
    options, the loop's variables, recover's arguments, the fields of its answer, and acting on a
    retry on fewer nodes."""
    if not shapes_steps(slurm):
        return "", "", '--ranks "${SLURM_NTASKS:-1}"', "action exclude", ""
    return (
        '\\\n            --nodes="$nodes" --ntasks=$((nodes * per_node)) ',
        f"\n    local nodes={slurm.nodes} per_node={ranks_per_node(slurm)}",
        '--step-nodes "$nodes" \\\n            --ranks $((nodes * per_node))',
        "action exclude fewer",
        '\n            if [ -n "$fewer" ]; then nodes=$fewer; fi',
    )
