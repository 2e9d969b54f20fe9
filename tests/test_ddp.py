"""DDP semantics with real 2-process gloo groups on the CPU (tests/ranks.py). Gradient tests use the
real GPT-2 model and the trainer's own accumulation; the stop tests run the whole `qgtrain train`
path."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from qgtrain.config import TrainConfig
from qgtrain.runtime.distributed import process_group
from qgtrain.runtime.rendezvous import DistEnv, from_environ
from qgtrain.tasks.models import lm_loss
from qgtrain.training.parallel.step import accumulate_gradients
from qgtrain.training.parallel.strategy import strategy_for
from tests.helpers import rank_log, records, tiny_config, tiny_gpt2
from tests.ranks import run_ranks, train_rank

SEQ, VOCAB = 16, 257


def batch(samples: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (samples, SEQ), generator=torch.Generator().manual_seed(42))


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def ddp_gradients(micro_batches_per_rank: int, samples_per_micro: int) -> dict[str, object]:
    """One rank: DDP over this rank's share of `batch`, counting the gradient all-reduces it
    issues."""
    env = from_environ(os.environ)
    with process_group(env, torch.device("cpu"), 60, 60):
        model = tiny_gpt2()
        ddp = DDP(model)
        per_rank = micro_batches_per_rank * samples_per_micro
        mine = batch(per_rank * env.world_size)[env.rank * per_rank : (env.rank + 1) * per_rank]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            accumulate_gradients(
                ddp,
                lm_loss,
                list(mine.split(samples_per_micro)),
                "fp32",
                torch.amp.GradScaler("cpu", enabled=False),
                torch.device("cpu"),
                strategy=strategy_for(TrainConfig(), env, torch.device("cpu")),
            )
        reduces = sum(
            1 for event in prof.events() if "allreduce" in event.name.replace("_", "").lower()
        )
        return {"grads": grads(model), "allreduce_calls": reduces}


def single_process_gradients(samples: int) -> dict[str, torch.Tensor]:
    model = tiny_gpt2()
    accumulate_gradients(
        model,
        lm_loss,
        [batch(samples)],
        "fp32",
        torch.amp.GradScaler("cpu", enabled=False),
        torch.device("cpu"),
        strategy=strategy_for(TrainConfig(), DistEnv(), torch.device("cpu")),
    )
    return grads(model)


def test_two_rank_gradients_equal_one_process_on_the_concatenated_batch():
    ranks = run_ranks(2, ddp_gradients, 1, 4)
    expected = single_process_gradients(8)
    for result in ranks:
        for name, grad in expected.items():
            torch.testing.assert_close(result["grads"][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_no_sync_accumulation_equals_one_k_times_larger_batch_and_reduces_once():
    k = 3
    ranks = run_ranks(2, ddp_gradients, k, 2)
    expected = single_process_gradients(2 * k * 2)
    buckets_per_step = run_ranks(2, ddp_gradients, 1, 2)[0]["allreduce_calls"]
    assert buckets_per_step >= 1, (
        "the profiler must see DDP's all-reduce, or the count below proves nothing"
    )
    for result in ranks:
        assert result["allreduce_calls"] == buckets_per_step, (
            "gradients must be reduced on the last micro-step only"
        )
        for name, grad in expected.items():
            torch.testing.assert_close(result["grads"][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def synthetic(*sets: str):  # type: ignore[no-untyped-def]
    """TINY with 101 samples (ranks get uneven validation shards), a validation every 2 steps, no
    checkpoints."""
    return tiny_config(
        "data.synthetic_samples=101", "train.eval_every=2", "checkpoint.every_steps=0", *sets
    )


def errors_of_failing_ranks(tmp_path: Path, *sets: str) -> list[str]:
    """Two ranks of synthetic(*sets) in tmp_path/run, each of which must exit 1: their errors."""
    results = run_ranks(2, train_rank, synthetic(*sets), str(tmp_path / "run"))
    for result in results:
        assert result["exit"] == 1
    return [result["error"] for result in results]


def test_ranks_with_different_validation_shards_all_stop_early_on_the_same_step(tmp_path):
    # lr 0: the validation loss never improves, so patience 2 ends the run at the third validation
    # (step 6). 101 synthetic samples leave 5 for validation: rank 0 evaluates 3 of them, rank 1
    # evaluates 2.
    cfg = synthetic(
        "optim.lr=0", "optim.min_lr=0", "early_stopping.patience=2", "train.max_steps=50"
    )
    results = run_ranks(2, train_rank, cfg, str(tmp_path / "run"))
    assert [r["exit"] for r in results] == [0, 0], results
    for rank in (0, 1):
        assert "early stopping at step 6" in rank_log(tmp_path / "run", rank)
    state = json.loads((tmp_path / "run" / "checkpoints" / "step-6" / "state.json").read_text())
    assert (
        state["trainer"]["outcome"] == "stopped early" and state["trainer"]["evals_since_best"] == 2
    )


def validate_from_diverged_states() -> dict[str, Any]:
    """One rank's validation where the ranks' early-stopping counts differ: rank 1, deciding for
    itself, would stop (5 validations without improvement, patience 2); rank 0 would not (0)."""
    from qgtrain.config import EarlyStoppingConfig
    from qgtrain.data.loaders import Loaders
    from qgtrain.state.train_state import TrainState
    from qgtrain.training.parallel.step import ParallelModel
    from qgtrain.training.timing import StepTimer
    from qgtrain.training.validation import Validator

    env = from_environ(os.environ)
    cpu = torch.device("cpu")
    with process_group(env, cpu, 60, 60):
        model = torch.nn.Linear(2, 2)
        parallel = ParallelModel(
            strategy_for(TrainConfig(), env, cpu),
            model,
            model,
            torch.optim.SGD(model.parameters()),
            torch.amp.GradScaler("cpu", enabled=False),
            "fp32",
        )
        validator = Validator(
            parallel,
            None,  # type: ignore[arg-type]  # no split is evaluated: only the decision is made
            Loaders(None, None, None, None),  # type: ignore[arg-type]
            EarlyStoppingConfig(metric="val_loss", patience=2),
            0,
            "fp32",
            env,
            cpu,
            StepTimer(0),
        )
        state = TrainState(step=4, best_metric=1.5, evals_since_best=0)
        if env.rank == 1:
            state.best_metric, state.evals_since_best = 0.5, 5
        stop = validator.validate(state)
        return {"stop": stop, "best": state.best_metric, "since": state.evals_since_best}


def test_the_early_stopping_decision_is_rank_0s_on_every_rank():
    """Every rank takes rank 0's decision and count, whatever its own state would say: a rank that
    decided for itself here would stop alone and leave the other waiting in its next collective."""
    assert (
        run_ranks(2, validate_from_diverged_states)
        == [{"stop": False, "best": 1.5, "since": 1}] * 2
    )


def test_a_non_finite_loss_on_one_rank_stops_every_rank_before_the_bad_update(tmp_path):
    for error in errors_of_failing_ranks(
        tmp_path,
        "model.factory=tests.factories:nan_on_rank_one_at_step_three",
        "train.max_steps=10",
        "checkpoint.every_steps=1",
    ):
        assert "the loss became non-finite at step 3 on rank(s) [1]" in error
        assert "HINT" in error
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert saved == ["step-1", "step-2"], "the bad step must not be checkpointed"


def test_an_uneven_dataset_over_several_epochs_does_not_hang(tmp_path):
    # 91 training samples over 2 ranks with batches of 4: an odd split, a partial last batch, 4
    # epochs.
    cfg = synthetic("train.max_steps=45", "train.eval_every=10")
    results = run_ranks(2, train_rank, cfg, str(tmp_path / "run"), timeout=120)
    assert [r["exit"] for r in results] == [0, 0]
    last = records(tmp_path / "run")[-1]
    assert last["step"] == 45 and last["epoch"] == 3 and last["val_loss"] is not None


@pytest.mark.parametrize("find_unused", [False, True])
def test_parameters_without_gradients_are_named_with_the_fix(tmp_path, find_unused):
    cfg = synthetic(
        "model.factory=tests.factories:with_unused_head",
        "train.max_steps=3",
        f"train.find_unused_parameters={find_unused}",
    )
    results = run_ranks(2, train_rank, cfg, str(tmp_path / "run"))
    if find_unused:
        assert [r["exit"] for r in results] == [0, 0], results
        return
    for result in results:
        assert result["exit"] == 1
        assert (
            "2 parameter(s) received no gradient in step 1 on rank(s) [0, 1]: unused_head.weight, "
            "unused_head.bias" in result["error"]
        )
        assert "train.find_unused_parameters: true" in result["error"]


def test_replicas_that_diverge_stop_the_run_at_the_checkpoint_naming_the_tensor(tmp_path):
    for error in errors_of_failing_ranks(
        tmp_path,
        "model.factory=tests.factories:drifts_apart",
        "train.max_steps=10",
        "checkpoint.every_steps=4",
    ):
        assert (
            "the ranks' copies of the model differ at step 4: scale; no checkpoint was written"
            in error
        )
    assert not (tmp_path / "run" / "checkpoints").exists() or not any(
        (tmp_path / "run" / "checkpoints").iterdir()
    )


def join_after(delays: dict[int, float]) -> int:
    env = from_environ(os.environ)
    time.sleep(delays.get(env.rank, 0.0))
    with process_group(env, torch.device("cpu"), 60, 60):
        return int(torch.distributed.get_world_size())


def test_a_rank_that_starts_before_rank_0_opens_the_store_still_joins():
    """The other ranks probe rank 0's port before joining; they must wait through a late rank 0, not
    fail."""
    assert run_ranks(2, join_after, {0: 1.5}) == [2, 2]


def test_a_rank_whose_rank_0_never_comes_stops_with_the_address_and_a_hint(monkeypatch):
    from qgtrain.foundation.errors import RendezvousError
    from tests.ranks import free_port

    port = free_port()
    # set by the process group in this process
    for name in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        monkeypatch.setenv(name, "lo")
    env = from_environ(
        {
            "RANK": "1",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    with pytest.raises(
        RendezvousError, match=rf"rank 1 could not join 2 ranks at 127.0.0.1:{port} within 2s.*HINT"
    ):
        with process_group(env, torch.device("cpu"), 2, 60):
            pass
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_gradient_accumulation_through_the_trainer_trains_as_the_big_batch(tmp_path, parallel):
    """train.grad_accum_steps=2 with batch 4 takes the same samples and the same steps as batch 8:
    every logged loss (which follows every update before it) agrees within float32 rounding, on 2
    ranks."""
    sharding = ["train.parallel=fsdp", "train.shard_modules=[Linear]"] if parallel == "fsdp" else []
    common = ["data.synthetic_samples=400", "train.max_steps=6", "train.eval_every=0", *sharding]
    losses = {}
    for name, sets in (
        ("big", ["train.batch_size=8"]),
        ("accumulated", ["train.batch_size=4", "train.grad_accum_steps=2"]),
    ):
        results = run_ranks(2, train_rank, synthetic(*common, *sets), str(tmp_path / name))
        assert [r["exit"] for r in results] == [0, 0], results
        losses[name] = [r["loss"] for r in records(tmp_path / name) if "loss" in r]
    assert len(losses["big"]) == 6
    assert losses["accumulated"] == pytest.approx(losses["big"], rel=1e-5)
    assert losses["big"][-1] < losses["big"][0], "it trains"
