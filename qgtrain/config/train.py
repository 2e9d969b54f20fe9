"""The train section: the loop's length, batch, precision, parallel strategy, time limits, loss
spikes, EMA and profiles, and the rules between them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from ..foundation.durations import duration_s
from .fields import MAX_TIMEOUT_S, Problem, setting

if TYPE_CHECKING:
    from .run import RunConfig


@dataclass(frozen=True)
class TrainConfig:
    run_name: str = setting("tiny-gpt2", "the run directory is <logging.runs_dir>/<run_name>")
    max_steps: int = setting(600, "optimizer steps to train for", min=1)
    seed: int = setting(1337, "seed for weights, data order and dropout", min=0, max=2**31 - 1)
    batch_size: int = setting(16, "samples per micro-batch, per rank", min=1)
    grad_accum_steps: int = setting(1, "micro-batches per optimizer step", min=1)
    precision: Literal["auto", "fp32", "bf16", "fp16"] = setting(
        "auto",
        "auto: bf16 where the GPU computes it natively (compute capability 8.0+), else "
        "fp32; fp16 uses a GradScaler; fp32 multiplies matrices in TF32 on compute capability "
        "8.0+",
    )
    device: Literal["auto", "cpu", "cuda"] = setting(
        "auto", "auto: a GPU if one is visible: the task's own, or the one at its local rank"
    )
    log_every: int = setting(10, "steps between logged (all-reduced) losses", min=1)
    eval_every: int = setting(100, "steps between validations (0 = only at the end)", min=0)
    eval_batches: int = setting(20, "validation batches per rank (0 = the whole split)", min=0)
    agree_every: int = setting(
        1, "steps between the all-reduce that agrees on stop signals and bad losses", min=1
    )
    find_unused_parameters: bool = setting(
        False, "let DDP skip parameters that get no gradient (slower)"
    )
    parallel: Literal["ddp", "fsdp", "hsdp"] = setting(
        "ddp",
        "ddp: a full copy of the model on every rank; fsdp: weights, gradients and "
        "optimizer state sharded over the ranks (FSDP2), for models too big for ddp; hsdp: "
        "sharded within a node, replicated across nodes",
    )
    shard_modules: tuple[str, ...] = setting(
        (),
        "with fsdp: class names of the blocks sharded one by one ([] = the model's "
        "_no_split_modules, as Hugging Face models name them)",
    )
    shard_group_size: int = setting(
        0, "with hsdp: ranks that share one copy of the model (0 = one node's)", min=0
    )
    activation_checkpointing: bool = setting(
        False,
        "recompute each block's activations in the backward pass: less memory, about a "
        "third more compute",
    )
    sync_batchnorm: bool = setting(
        False,
        "with ddp on GPUs: batch norm layers normalize by the statistics of all ranks' "
        "batches together (SyncBatchNorm), as Lightning's sync_batchnorm",
    )
    cpu_threads: int = setting(
        0, "torch threads per rank on CPU (0 = the CPUs of this task / ranks per node)", min=0
    )
    max_time: str = setting(
        "",
        "stop at a checkpoint before this much time has passed, e.g. 3h30m or 2:00:00 ('' = "
        "none; under Slurm the job's own time limit is always kept)",
    )
    stop_margin_s: float = setting(
        60.0,
        "seconds kept free before a time limit, beyond the measured time of a step and a "
        "checkpoint",
        min=0.0,
        max=MAX_TIMEOUT_S,
    )
    time_limit_check_s: float = setting(
        300.0,
        "seconds between readings of the Slurm job's time limit, which an admin may "
        "extend while it runs",
        min=5.0,
        max=MAX_TIMEOUT_S,
    )
    startup_timeout_s: float = setting(
        600.0, "seconds to wait for all ranks to join", min=1.0, max=MAX_TIMEOUT_S
    )
    collective_timeout_s: float = setting(
        300.0,
        "seconds a collective of a step or a checkpoint save may wait for a peer before failing",
        min=1.0,
        max=MAX_TIMEOUT_S,
    )
    socket_ifname: str = setting(
        "",
        "the network interface NCCL and gloo use, e.g. ib0 ('' = the one whose address "
        "routes to MASTER_ADDR, unless NCCL_/GLOO_SOCKET_IFNAME are set)",
    )
    peak_tflops: float = setting(
        0.0,
        "one GPU's peak TFLOP/s in the run's precision, for mfu (0 = from qgtrain's table "
        "of GPUs; none for a GPU it lacks)",
        min=0.0,
    )
    spike_factor: float = setting(
        0.0,
        "a step whose loss (all ranks' mean) is above this x the median of the last "
        "train.spike_window applied steps' losses is a spike: its update is not applied, its "
        "batch is dropped and the step taken again with the next batch (0 = off, else above 1; "
        "costs an all-reduce of the loss and a host read of one flag per step)",
        min=0.0,
    )
    spike_window: int = setting(
        50,
        "applied steps whose losses the spike median is taken over; decisions start once "
        "min(this, 10) losses are known",
        min=2,
    )
    skip_steps: tuple[int, ...] = setting(
        (),
        "steps whose batch is dropped and the step taken again with the next, as after a "
        'spike: the steps of a run\'s "skipped" records repeat it from its start (a step listed '
        "twice drops two batches)",
    )
    max_skips: int = setting(
        10,
        "loss spikes skipped in a run before it stops: more are the data's or the learning "
        "rate's fault, not one batch's",
        min=0,
    )
    spike_action: Literal["skip", "rollback"] = setting(
        "skip",
        "what a spike does: skip (its update is not applied) or rollback (the weights "
        "may be damaged already: every rank goes back to the latest checkpoint and skips the "
        "batches drawn since; counted against train.max_skips)",
    )
    ema_decay: float = setting(
        0.0,
        "keep an EMA of the weights, ema = d * ema + (1 - d) * weights after every applied "
        "step, in [0, 1) (0 = off; 0.999 averages over about the last 1000 steps); checkpointed, "
        "exported with `qgtrain export RUN --weights ema`",
    )
    eval_ema: bool = setting(
        False,
        "validate and test with the EMA of the weights (train.ema_decay > 0); training "
        "goes on with its own weights",
    )
    profile_steps: tuple[int, ...] = setting(
        (),
        "[first, last]: torch.profiler traces of these steps on every rank, into <run "
        "dir>/profiles (one warm-up step before; [] = none)",
    )
    memory_snapshot: bool = setting(
        False,
        "with train.profile_steps on a GPU: also record every CUDA allocation over those "
        "steps, for pytorch.org/memory_viz",
    )


def training_rules(cfg: RunConfig) -> Problem:
    train = cfg.train
    if train.parallel != "ddp" and train.precision == "fp16":
        return "train.precision", (
            "fp16 needs loss scaling, which qgtrain does not do on sharded gradients; use "
            f"bf16 with train.parallel: {train.parallel}"
        )
    if train.shard_group_size and train.parallel != "hsdp":
        return "train.shard_group_size", (
            f"applies to train.parallel: hsdp, not {train.parallel}; set it to 0"
        )
    if train.precision == "fp16" and train.device == "cpu":
        return "train.precision", "fp16 needs a GPU; use bf16 or fp32 on CPU"
    name = train.run_name
    if (
        not name.strip()
        or name != name.strip()
        or "/" in name
        or name in (".", "..")
        or any(ord(c) < 32 for c in name)
    ):
        return "train.run_name", (
            f"{name!r} must be a plain directory name: not empty, no '/', no leading or "
            "trailing spaces, no control characters"
        )
    if train.max_time and duration_s(train.max_time) is None:
        return "train.max_time", (
            f"{train.max_time!r} is not a duration; use e.g. 45m, 3h30m, 1d2h, 90s, or "
            "Slurm's HH:MM:SS or D-HH:MM:SS"
        )
    if not 0.0 <= train.ema_decay < 1.0:
        return "train.ema_decay", (
            f"{train.ema_decay} is outside [0, 1): 0 turns the EMA of the weights off, a value "
            "below 1 such as 0.999 keeps it"
        )
    if train.eval_ema and not train.ema_decay:
        return "train.eval_ema", "needs an EMA of the weights: set train.ema_decay, e.g. 0.999"
    return None


def spike_rules(cfg: RunConfig) -> Problem:
    train = cfg.train
    if 0 < train.spike_factor <= 1:
        return "train.spike_factor", (
            f"{train.spike_factor} would call a loss at or below the recent median a spike; use 0 "
            "(off) or a factor above 1, e.g. 3"
        )
    for step in train.skip_steps:
        if not 1 <= step <= train.max_steps:
            return "train.skip_steps", (
                f"step {step} is not a step of this run; list steps from 1 to train.max_steps="
                f"{train.max_steps}"
            )
    if (train.spike_factor or train.skip_steps) and train.precision == "fp16":
        key = "train.spike_factor" if train.spike_factor else "train.skip_steps"
        return key, (
            "fp16's loss scaler decides itself which updates to skip and takes no other "
            "flag; use train.precision: bf16 or fp32 to skip steps"
        )
    return _rollback_rule(cfg) or _profile_rule(cfg)


def _rollback_rule(cfg: RunConfig) -> Problem:
    if cfg.train.spike_action != "rollback":
        return None
    if not cfg.train.spike_factor:
        return "train.spike_action", (
            "rollback acts on loss spikes, which train.spike_factor: 0 "
            "does not look for; set train.spike_factor above 1, e.g. 3, "
            "or use skip"
        )
    if not cfg.checkpoint.every_steps and not cfg.checkpoint.every_minutes:
        return "train.spike_action", (
            "rollback goes back to the latest checkpoint, and "
            "checkpoint.every_steps and checkpoint.every_minutes are "
            "both 0 (none is written before the end); set "
            "checkpoint.every_steps, e.g. 10, or use skip"
        )
    return None


def _profile_rule(cfg: RunConfig) -> Problem:
    steps, last = cfg.train.profile_steps, cfg.train.max_steps
    if steps and (len(steps) != 2 or not 1 <= steps[0] <= steps[1] <= last):
        return "train.profile_steps", (
            f"{list(steps)} is not [first, last] with 1 <= first <= last <= "
            f"train.max_steps={last}; "
            "e.g. [100, 105], or [] for none"
        )
    if cfg.train.memory_snapshot and not steps:
        return "train.memory_snapshot", (
            "it records over train.profile_steps, which is empty; name the steps, e.g. [100, 105]"
        )
    return None
