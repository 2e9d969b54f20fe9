"""The run configuration: one frozen dataclass per section of config.yaml, and the rules between
fields (written in configrules.py).

Every field carries its own documentation and bounds in `metadata`, so the loader (configload.py) can
validate a file and explain a mistake without a second copy of the schema. World size and ranks are
deliberately absent: the scheduler supplies them (rendezvous.py).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from .configrules import model_and_data_rules, reporting_rules, spike_rules, training_rules
from .errors import ConfigError
from .optimrules import optim_rules
from .task import BUILTIN_LM

MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week: longer than any job's time limit, within what timers can hold


def setting(default: Any, doc: str, *, min: float | None = None, max: float | None = None) -> Any:
    """A config field with its documentation and numeric bounds (inclusive)."""
    metadata = {"doc": doc, "min": min, "max": max}
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class TaskConfig:
    factory: str = setting(BUILTIN_LM, "'package.module:function' called with the resolved config on every rank, "
                           "returning a qgtrain.Task (default: the built-in causal LM, set up by model and data)")
    options: dict[str, Any] = setting({}, "free-form settings for your task function, read as "
                                      "cfg.task.options (--set task.options.NAME=VALUE)")


@dataclass(frozen=True)
class ModelConfig:
    arch: str = setting("gpt2", "transformers model_type built from a config with random init (gpt2, llama, ...)")
    pretrained: str | None = setting(None, "folder with a saved model (config.json + weights): fine-tune it, offline")
    factory: str | None = setting(None, "'package.module:function' called with (vocab_size, seq_len), "
                                 "returning a torch.nn.Module that maps input_ids to logits")
    layers: int = setting(4, "transformer blocks", min=1)
    heads: int = setting(4, "attention heads per block", min=1)
    hidden: int = setting(128, "width of the residual stream", min=8)
    dropout: float = setting(0.0, "dropout probability in every block", min=0.0, max=0.9)
    compile: bool = setting(False, "torch.compile the model before wrapping it in DDP")


@dataclass(frozen=True)
class DataConfig:
    name: Literal["corpus", "files", "synthetic", "factory"] = setting(
        "corpus", "corpus: the built-in text; files: your data files (data.files); synthetic: random tokens "
        "(tests); factory")
    corpus: str = setting("stdlib", "'stdlib' (Python's own sources, always present) or a .txt file or folder")
    corpus_mb: float = setting(4.0, "megabytes of text taken from the corpus", min=0.01)
    tokenizer: str = setting("byte", "'byte' (byte-level, 257 tokens) or a folder with a Hugging Face tokenizer")
    cache_dir: str = setting("data", "where tokenized corpora are cached, shared by runs with the same text")
    seq_len: int = setting(128, "tokens per training sample", min=2)
    val_fraction: float = setting(0.05, "share of the corpus held out for validation", min=0.0, max=0.5)
    test_fraction: float = setting(0.05, "share of the corpus held out for the final test", min=0.0, max=0.5)
    files: tuple[str, ...] = setting((), "with name=files: globs, files or folders of text: .txt, .jsonl, .json, "
                                     ".jsonl.gz, .parquet, or a folder written by datasets' save_to_disk")
    val_files: tuple[str, ...] = setting((), "the validation split's files ([] = hold out data.val_fraction "
                                         "of the documents in data.files)")
    test_files: tuple[str, ...] = setting((), "the test split's files ([] = hold out data.test_fraction)")
    text_field: str = setting("text", "the JSON field or parquet/arrow column that holds each document's text")
    split_seed: int = setting(0, "which documents the held-out fractions take (a change re-tokenizes)",
                              min=0, max=2**31 - 1)
    prepare_workers: int = setting(0, "processes that tokenize data files (0 = every CPU the job was given)",
                                   min=0)
    prepare_timeout_s: float = setting(86400.0, "seconds the other ranks wait for the data to be tokenized",
                                       min=1.0, max=MAX_TIMEOUT_S)
    num_workers: int = setting(0, "DataLoader worker processes per rank", min=0)
    synthetic_samples: int = setting(4096, "samples in the synthetic set", min=1)
    factory: str | None = setting(None, "'package.module:function' called with (seq_len, seed), returning "
                                  "(train, val, test, vocab_size)")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = setting(2e-3, "peak learning rate", min=0.0)
    min_lr: float = setting(2e-4, "learning rate at the end of the decay", min=0.0)
    warmup_steps: int = setting(50, "steps of linear warmup from 0 to lr", min=0)
    weight_decay: float = setting(0.1, "weight decay on matrices, not on biases and norms (optimizers "
                                  "that take one)", min=0.0)
    beta1: float = setting(0.9, "beta1 of adamw, adam and classes that take betas", min=0.0, max=1.0)
    beta2: float = setting(0.95, "beta2 of adamw, adam and classes that take betas", min=0.0, max=1.0)
    eps: float = setting(1e-8, "epsilon of adamw, adam and classes by path that take eps", min=0.0)
    grad_clip: float = setting(1.0, "clip the global gradient norm to this (0 = off)", min=0.0)
    name: str = setting("adamw", "adamw, adam, sgd, adafactor, muon (matrices only, ddp), or an optimizer "
                        "class by path: torch.optim.RMSprop, mypkg.opt:Lion, path/to/file.py:Lion")
    args: dict[str, Any] = setting({}, "further keyword arguments of the optimizer, e.g. {momentum: 0.9, "
                                   "nesterov: true}; lr, betas, eps and weight_decay come from optim.*")
    schedule: str = setting("cosine", "cosine, linear, constant, wsd (warmup, flat at lr, decay at the end), "
                            "inverse_sqrt, or 'package.module:function' called with (step, max_steps, "
                            "optim) returning the learning rate")
    decay_fraction: float = setting(0.2, "wsd: the share of train.max_steps at the end over which the "
                                    "learning rate decays to min_lr, in (0, 1]")
    decay_shape: Literal["linear", "cosine", "sqrt"] = setting(
        "linear", "wsd, and a new decay after optim.rewarm_steps: its shape (sqrt: 1 - sqrt(progress))")
    rewarm_steps: int | None = setting(
        None, "a resume whose new train.max_steps would change the learning rate: null refuses it; N >= 0 "
        "starts a new decay from the current learning rate, N steps up to optim.lr first", min=0)


@dataclass(frozen=True)
class TrainConfig:
    run_name: str = setting("tiny-gpt2", "the run directory is <logging.runs_dir>/<run_name>")
    max_steps: int = setting(600, "optimizer steps to train for", min=1)
    seed: int = setting(1337, "seed for weights, data order and dropout", min=0, max=2**31 - 1)
    batch_size: int = setting(16, "samples per micro-batch, per rank", min=1)
    grad_accum_steps: int = setting(1, "micro-batches per optimizer step", min=1)
    precision: Literal["auto", "fp32", "bf16", "fp16"] = setting(
        "auto", "auto: bf16 where the GPU computes it natively (compute capability 8.0+), else fp32; fp16 uses a "
        "GradScaler; fp32 multiplies matrices in TF32 on compute capability 8.0+")
    device: Literal["auto", "cpu", "cuda"] = setting("auto", "auto: a GPU if one is visible: the task's own, or "
                                                     "the one at its local rank")
    log_every: int = setting(10, "steps between logged (all-reduced) losses", min=1)
    eval_every: int = setting(100, "steps between validations (0 = only at the end)", min=0)
    eval_batches: int = setting(20, "validation batches per rank (0 = the whole split)", min=0)
    agree_every: int = setting(1, "steps between the all-reduce that agrees on stop signals and bad losses",
                               min=1)
    find_unused_parameters: bool = setting(False, "let DDP skip parameters that get no gradient (slower)")
    parallel: Literal["ddp", "fsdp", "hsdp"] = setting(
        "ddp", "ddp: a full copy of the model on every rank; fsdp: weights, gradients and optimizer state "
        "sharded over the ranks (FSDP2), for models too big for ddp; hsdp: sharded within a node, replicated "
        "across nodes")
    shard_modules: tuple[str, ...] = setting((), "with fsdp: class names of the blocks sharded one by one "
                                             "([] = the model's _no_split_modules, as Hugging Face models name them)")
    shard_group_size: int = setting(0, "with hsdp: ranks that share one copy of the model (0 = one node's)", min=0)
    activation_checkpointing: bool = setting(False, "recompute each block's activations in the backward pass: "
                                             "less memory, about a third more compute")
    sync_batchnorm: bool = setting(False, "with ddp on GPUs: batch norm layers normalize by the statistics of "
                                   "all ranks' batches together (SyncBatchNorm), as Lightning's sync_batchnorm")
    cpu_threads: int = setting(0, "torch threads per rank on CPU (0 = the CPUs of this task / ranks per node)",
                               min=0)
    max_time: str = setting("", "stop at a checkpoint before this much time has passed, e.g. 3h30m or 2:00:00 "
                            "('' = none; under Slurm the job's own time limit is always kept)")
    stop_margin_s: float = setting(60.0, "seconds kept free before a time limit, beyond the measured time of "
                                   "a step and a checkpoint", min=0.0, max=MAX_TIMEOUT_S)
    time_limit_check_s: float = setting(300.0, "seconds between readings of the Slurm job's time limit, which an "
                                        "admin may extend while it runs", min=5.0, max=MAX_TIMEOUT_S)
    startup_timeout_s: float = setting(600.0, "seconds to wait for all ranks to join", min=1.0, max=MAX_TIMEOUT_S)
    collective_timeout_s: float = setting(300.0, "seconds a collective of a step or a checkpoint save may "
                                          "wait for a peer before failing",
                                          min=1.0, max=MAX_TIMEOUT_S)
    socket_ifname: str = setting("", "the network interface NCCL and gloo use, e.g. ib0 ('' = the one whose "
                                 "address routes to MASTER_ADDR, unless NCCL_/GLOO_SOCKET_IFNAME are set)")
    peak_tflops: float = setting(
        0.0, "one GPU's peak TFLOP/s in the run's precision, for mfu (0 = from qgtrain's table of "
        "GPUs; none for a GPU it lacks)", min=0.0)
    spike_factor: float = setting(
        0.0, "a step whose loss (all ranks' mean) is above this x the median of the last train.spike_window "
        "applied steps' losses is a spike: its update is not applied, its batch is dropped and the step taken "
        "again with the next batch (0 = off, else above 1; costs an all-reduce of the loss and a host read of "
        "one flag per step)", min=0.0)
    spike_window: int = setting(50, "applied steps whose losses the spike median is taken over; decisions "
                                "start once min(this, 10) losses are known", min=2)
    skip_steps: tuple[int, ...] = setting((), "steps whose batch is dropped and the step taken again with the "
                                          "next, as after a spike: the steps of a run's \"skipped\" records "
                                          "repeat it from its start (a step listed twice drops two batches)")
    max_skips: int = setting(10, "loss spikes skipped in a run before it stops: more are the data's or the "
                             "learning rate's fault, not one batch's", min=0)
    spike_action: Literal["skip", "rollback"] = setting(
        "skip", "what a spike does: skip (its update is not applied) or rollback (the weights may be damaged "
        "already: every rank goes back to the latest checkpoint and skips the batches drawn since; counted "
        "against train.max_skips)")
    ema_decay: float = setting(
        0.0, "keep an EMA of the weights, ema = d * ema + (1 - d) * weights after every applied step, in "
        "[0, 1) (0 = off; 0.999 averages over about the last 1000 steps); checkpointed, exported with "
        "`qgtrain export RUN --weights ema`")
    eval_ema: bool = setting(False, "validate and test with the EMA of the weights (train.ema_decay > 0); "
                             "training goes on with its own weights")


@dataclass(frozen=True)
class EarlyStoppingConfig:
    patience: int = setting(0, "validations without improvement before stopping (0 = off)", min=0)
    min_delta: float = setting(0.0, "improvement in the metric that counts", min=0.0)
    metric: str = setting("val_loss", "what early stopping and the best checkpoint follow: val_loss or "
                          "val_<name> for a metric the task reports")
    mode: Literal["min", "max"] = setting("min", "min: lower is better (losses); max: higher is better (accuracy)")


@dataclass(frozen=True)
class CheckpointConfig:
    every_steps: int = setting(200, "steps between checkpoints (0 = off)", min=0)
    every_minutes: float = setting(0.0, "minutes between checkpoints, agreed by all ranks (0 = off)", min=0.0)
    keep_last: int = setting(3, "checkpoints kept besides the best one (at least 2)")
    resume: str = setting("auto", "auto: the latest valid checkpoint of the run; never; or a checkpoint path")
    async_save: bool = setting(False, "copy state to memory at the step and write it in the background")


@dataclass(frozen=True)
class SlurmConfig:
    job_name: str = setting("qgtrain", "#SBATCH --job-name")
    nodes: int = setting(1, "#SBATCH --nodes", min=1)
    gpus_per_node: int = setting(0, "GPUs per node; one task (rank) per GPU", min=0)
    tasks_per_node: int = setting(0, "ranks per node when gpus_per_node is 0 (0 = 1)", min=0)
    cpus_per_task: int = setting(4, "#SBATCH --cpus-per-task", min=1)
    mem: str = setting("", "#SBATCH --mem, e.g. 64G ('' = the cluster default)")
    time: str = setting("01:00:00", "#SBATCH --time: [days-]hours:minutes:seconds or minutes")
    partition: str = setting("", "#SBATCH --partition ('' = default)")
    account: str = setting("", "#SBATCH --account ('' = default)")
    qos: str = setting("", "#SBATCH --qos ('' = default)")
    constraint: str = setting("", "#SBATCH --constraint ('' = none)")
    signal: Literal["USR1", "USR2", "HUP", "URG"] = setting(
        "USR2", "the warning signal sent before the time limit; it makes every rank save and stop (NCCL has "
        "used USR1)")
    signal_lead_s: int = setting(120, "seconds before the time limit that slurm.signal is sent",
                                 min=30, max=3600)
    requeue: bool = setting(True, "requeue the job after a preemption or time-limit stop")
    max_restarts: int = setting(20, "stop requeueing after this many restarts", min=0)
    step_retries: int = setting(2, "times a step that failed for a reason that may pass (a rank died, a node "
                                "vanished) is run again inside the allocation before the job is requeued",
                                min=0, max=10)
    output_dir: str = setting("jobs/out", "where Slurm writes the job's stdout/stderr")
    extra_sbatch: tuple[str, ...] = setting((), "more #SBATCH options, e.g. ['--exclusive']")
    setup: tuple[str, ...] = setting((), "shell lines run before srun, e.g. ['module load cuda/12.4']")
    container_image: str = setting("", "pyxis: run every task in this image, e.g. nvcr.io#nvidia/pytorch:24.08-py3 "
                                   "with qgtrain installed ('' = none)")
    container_mounts: tuple[str, ...] = setting((), "SRC:DST[:FLAGS] mounts into the container, besides the "
                                                "working directory")
    apptainer_image: str = setting("", "apptainer: run every task with `apptainer exec` in this image ('' = none)")
    snapshot: bool = setting(True, "run every attempt of the job (requeues too) from a copy of the submit "
                             "directory and qgtrain taken at submit, in <run dir>/code/<hash>")
    snapshot_max_mb: float = setting(50.0, "refuse to submit when that copy would be larger (MB)", min=0.001)


@dataclass(frozen=True)
class ExportConfig:
    on_finish: bool = setting(False, "export a Hugging Face model when training finishes (rank 0)")
    dir: str = setting("", "where the export goes ('' = <run dir>/export)")
    dtype: Literal["auto", "bf16", "fp32"] = setting("auto", "the exported weights' dtype (auto: bf16 if the run "
                                                     "trained in bf16, else fp32)")


@dataclass(frozen=True)
class LoggingConfig:
    runs_dir: str = setting("runs", "parent of every run directory")
    level: Literal["DEBUG", "INFO", "WARNING"] = setting("INFO", "console and log-file level")
    tensorboard: bool = setting(True, "write TensorBoard events to <run dir>/tb (rank 0)")
    trackers: tuple[str, ...] = setting((), "experiment trackers besides TensorBoard: wandb, mlflow (optional "
                                        "extras); one tracker run per qgtrain run, across requeues")
    wandb_project: str = setting("qgtrain", "the W&B project")
    wandb_mode: Literal["offline", "online"] = setting(
        "offline", "offline: write locally, upload later with `wandb sync` (compute nodes often have no network)")
    mlflow_uri: str = setting(
        "", "MLflow tracking URI ('' = a file store in <runs_dir>/mlruns), without credentials: "
        "set MLFLOW_TRACKING_USERNAME/PASSWORD or _TOKEN in the environment")
    mlflow_experiment: str = setting("qgtrain", "the MLflow experiment")
    progress: Literal["auto", "bar", "lines"] = setting(
        "auto", "auto: a progress bar on a terminal, plain lines in Slurm output files")
    memory_warn_gb: float = setting(0.0, "warn when a rank's CPU RSS or GPU peak passes this (0 = off)",
                                    min=0.0)
    shared: bool = setting(
        False, "false: a new run directory is private to you (mode 0700); true: it follows your "
        "umask, for a group project, but is never writable by everyone")


@dataclass(frozen=True)
class RunConfig:
    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


SECTIONS: dict[str, type] = {f.name: typing.get_type_hints(RunConfig)[f.name] for f in fields(RunConfig)}


def check_rules(cfg: RunConfig, source: str) -> None:
    """Rules that involve more than one field; `source` names where the values came from."""
    for rules in (model_and_data_rules, training_rules, reporting_rules, spike_rules,
                  optim_rules):
        problem = rules(cfg)
        if problem is not None:
            key, text = problem
            raise ConfigError(f"{source}: {key}: {text}")
