"""What the ranks' replicas must agree on under DDP and FSDP. Runs against: real DDP on 2 gloo ranks
(tests/ranks.py) with a real batch norm layer, resumed the way run.py resumes (a new model and DDP,
rank 0's checkpoint loaded after wrapping), and real `qgtrain train` ranks for the refusals."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from qgtrain.config import TrainConfig
from qgtrain.config.load import load_config
from qgtrain.foundation.errors import TrainingError
from qgtrain.runtime.distributed import broadcast_from_main, diverged, process_group
from qgtrain.runtime.rendezvous import DistEnv, from_environ
from qgtrain.training import transforms
from qgtrain.training.parallel import replicas
from qgtrain.training.parallel.strategy import strategy_for
from tests.ranks import run_ranks, train_rank

CPU = torch.device("cpu")


class Normalized(nn.Module):
    """Batch norm between two layers, and a counter DDP is told to leave alone (each rank's own)."""

    _ddp_params_and_buffers_to_ignore = ["calls"]

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def train_steps(ddp: nn.Module, steps: range, rank: int) -> None:
    # stateless: nothing to checkpoint but the model
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in steps:
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(100 * step + rank)) * (
            rank + 1
        )
        optimizer.zero_grad()
        ddp(x).pow(2).mean().backward()
        optimizer.step()


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def batchnorm_under_ddp() -> dict[str, object]:
    env = from_environ(os.environ)
    out: dict[str, object] = {}
    with process_group(env, CPU, 60, 60):
        model = Normalized()
        ddp = DDP(model)
        out["broadcast"] = sorted(
            n
            for n, b in model.named_buffers()
            if any(b is t for t in replicas.broadcast_by_ddp(ddp))
        )
        train_steps(ddp, range(1, 4), env.rank)
        out["differ_between_forwards"] = diverged(list(model.named_buffers()), CPU)
        # does not raise: DDP repairs those at the next forward
        replicas.check_replicas_agree(model, ddp, 3, CPU)
        # model.pt: rank 0's, read by all
        own, checkpoint = state(model), broadcast_from_main(state(model))
        train_steps(ddp, range(4, 7), env.rank)
        uninterrupted = state(model)
        # Resumed as run.py does: a new process's model wrapped first, then the checkpoint loaded
        # into it. Rank 1 also tries a checkpoint holding its own stale buffers: DDP's first forward
        # copies rank 0's.
        for name, saved in (("rank 0's", checkpoint), ("own stale", own)):
            resumed = Normalized()
            resumed_ddp = DDP(resumed)
            resumed.load_state_dict(saved)
            train_steps(resumed_ddp, range(4, 7), env.rank)
            mine = state(resumed)
            out[f"resumed from {name} equals"] = all(
                torch.equal(mine[k], v) for k, v in uninterrupted.items()
            )
        replicas.take_main_values(replicas.broadcast_by_ddp(ddp))
        main = broadcast_from_main(state(model))
        out["evaluates with rank 0's"] = all(
            torch.equal(main[k], v) for k, v in state(model).items()
        )
        tensors = dict([*model.named_buffers(), *model.named_parameters()])
        for what in ("calls", "inner.3.bias"):  # changed on rank 1 only: no broadcast repairs these
            with torch.no_grad():
                tensors[what].add_(env.rank)
            try:
                replicas.check_replicas_agree(model, ddp, 7, CPU)
                out[what] = None
            except TrainingError as exc:
                out[what] = str(exc)
            with torch.no_grad():
                tensors[what].sub_(env.rank)
    return out


def test_batchnorm_buffers_are_rank_0s_in_checkpoints_evaluation_and_resume_while_real_divergence_stops():  # noqa: E501 (the test's name, which says what it proves)
    results = run_ranks(2, batchnorm_under_ddp)
    for rank, result in enumerate(results):
        assert result["broadcast"] == [
            "inner.1.num_batches_tracked",
            "inner.1.running_mean",
            "inner.1.running_var",
        ], "everything but the ignored counter"
        assert result["differ_between_forwards"] == ["inner.1.running_mean", "inner.1.running_var"]
        assert result["resumed from rank 0's equals"] and result["resumed from own stale equals"], (
            rank
        )
        assert result["evaluates with rank 0's"], rank
        assert (
            "the ranks' copies of the model differ at step 7: calls; no checkpoint was written"
            in result["calls"]
        )
        assert "differ at step 7: inner.3.bias;" in result["inner.3.bias"]


def test_the_choices_for_sync_batchnorm():
    def problem(parallel: str, device: str, world_size: int) -> str | None:
        strategy = strategy_for(
            TrainConfig(parallel=parallel), DistEnv(world_size=world_size), torch.device(device)
        )
        return strategy.sync_batchnorm_problem()

    assert problem("ddp", "cuda", 8) is None
    # one rank: nothing to synchronize
    assert problem("ddp", "cpu", 1) is None
    assert problem("fsdp", "cuda", 1) is None
    assert "SyncBatchNorm runs on GPUs only" in (problem("ddp", "cpu", 2) or "")
    assert "applies to train.parallel: ddp" in (problem("fsdp", "cuda", 2) or "")


def test_sync_batchnorm_converts_in_place_keeping_names_and_tensors():
    model = Normalized()
    before = dict(model.state_dict(keep_vars=True))
    assert transforms.to_sync_batchnorm(model, 2) == 1 and isinstance(
        model.inner[1], nn.SyncBatchNorm
    )
    after = dict(model.state_dict(keep_vars=True))
    assert after.keys() == before.keys() and all(after[k] is v for k, v in before.items())


def cli_config(tmp_path, *sets: str):  # type: ignore[no-untyped-def]
    return load_config(
        [],
        [
            "train.batch_size=8",
            "train.max_steps=4",
            "logging.tensorboard=false",
            "checkpoint.every_steps=2",
            *sets,
        ],
    )


@pytest.mark.parametrize(
    "sets, message",
    [
        (
            ("task=tests.tasks:rank_local_buffer",),
            "task.factory: the model's visits differ(s) across ranks when the task is built, and "
            "DDP does not copy them from rank 0 (they are in the model's "
            "_ddp_params_and_buffers_to_ignore)",
        ),
        (
            ("task=tests.tasks:points", "train.sync_batchnorm=true"),
            "train.sync_batchnorm: SyncBatchNorm runs on GPUs only (torch refuses CPU tensors), "
            "and these 2 ranks train on the CPU. HINT: set train.sync_batchnorm: false",
        ),
    ],
)
def test_what_no_rank_can_repair_is_refused_before_training(tmp_path, sets, message):
    results = run_ranks(2, train_rank, cli_config(tmp_path, *sets), str(tmp_path / "run"))
    for result in results:
        # the task's own code, or a config value
        code = 3 if message.startswith("task.factory") else 2
        assert (
            result["exit"] == code and message in result["error"] and "\n" not in result["error"]
        ), result
    assert not (tmp_path / "run" / "checkpoints").exists() or not any(
        (tmp_path / "run" / "checkpoints").iterdir()
    )
