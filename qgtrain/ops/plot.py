"""`qgtrain plot`: training curves of one or more runs, overlaid, as a PNG (headless matplotlib)."""

from __future__ import annotations

from pathlib import Path

from ..foundation.errors import QgtrainError
from ..runs.rundir import RunDir
from ..training.metrics import read_metrics

LABELS = {
    "loss": "training loss",
    "val_loss": "validation loss",
    "lr": "learning rate",
    "grad_norm": "gradient norm",
    "tokens_per_s": "tokens / s",
    "mem_rss_gb": "CPU memory (GB)",
    "mem_gpu_peak_gb": "GPU memory peak (GB)",
    "test_loss": "test loss",
}


def plot_runs(runs: list[Path], out: Path, metrics: list[str]) -> Path:
    """One panel per metric, one line per run (legend by run name), steps on a shared x axis."""
    series = {}
    for run in runs:
        path = RunDir(run).metrics
        if not path.exists():
            raise QgtrainError(
                f"plot: {run} has no metrics.jsonl; give run directories (e.g. runs/tiny-gpt2)"
            )
        series[run.name if run.name not in series else str(run)] = read_metrics(path)
    available = sorted(
        {
            k
            for records in series.values()
            for r in records
            for k, v in r.items()
            if isinstance(v, (int, float)) and k not in ("step", "epoch", "time")
        }
    )
    unknown = [m for m in metrics if m not in available]
    if unknown:
        raise QgtrainError(
            f"plot --metric: {', '.join(unknown)} not logged by these runs; available: "
            f"{', '.join(available)}"
        )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        len(metrics), 1, figsize=(9, 2.8 * len(metrics) + 0.6), sharex=True, squeeze=False
    )
    for ax, metric in zip(axes[:, 0], metrics):
        for name, records in series.items():
            points = [(r["step"], r[metric]) for r in records if r.get(metric) is not None]
            if points:
                steps, values = zip(*points)
                ax.plot(
                    steps,
                    values,
                    marker="o" if len(points) < 30 else None,
                    markersize=3,
                    label=name,
                )
        ax.set_ylabel(LABELS.get(metric, metric))
        ax.grid(True, alpha=0.3)
        if metric == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
        ax.legend(loc="best", fontsize="small")
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(", ".join(series) if len(series) < 4 else f"{len(series)} runs")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
