"""Parts of one training step, in one process: gradient clipping and the precision a model computes
in. Runs against: real modules and optimizers (and a real FSDP2 unit on a one-rank gloo group)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from tests.helpers import tiny_gpt2
from tests.ranks import run_ranks


def test_grad_clip_0_leaves_every_gradient_untouched_and_still_reports_the_norm():
    """Clipping to infinity would multiply each gradient by 1.0 in place: a pass over all of them
    per step (the version counter shows the in-place write)."""
    from qgtrain.training.parallel.step import clip_gradients

    model = torch.nn.Linear(4, 3)
    model(torch.ones(2, 4)).pow(2).sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    versions = [g._version for g in grads]
    norm = clip_gradients(model, 0.0, torch.device("cpu"))
    assert [g._version for g in grads] == versions
    torch.testing.assert_close(
        norm, torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
    )
    clip_gradients(model, 0.5, torch.device("cpu"))
    assert [g._version for g in grads] != versions  # a real bound still clips


def test_a_model_without_gradients_reports_norm_0_on_the_ranks_device():
    """The report stacks the norm with device tensors: torch's norm of no tensors is a CPU tensor,
    which a CUDA run cannot stack (shown here with the meta device, which CPU tensors do not mix
    with)."""
    from qgtrain.training.parallel.step import clip_gradients

    norm = clip_gradients(torch.nn.Linear(4, 3), 1.0, torch.device("meta"))
    assert norm.device == torch.device("meta") and norm.dim() == 0


def test_a_parallel_model_steps_as_the_plain_loop_and_names_unused_parameters_only_for_ddp():
    """ParallelModel, as the strategy's setup makes it on one rank: backward, clip and update give
    the plain loop's weights bit for bit and leave no gradient behind; a parameter the loss did not
    reach is named where DDP would wait for it, and not where the layout does not (one process) or
    train.find_unused_parameters looks for it."""
    from qgtrain.config import TrainConfig
    from qgtrain.runtime.rendezvous import from_environ
    from qgtrain.training.parallel.strategy import Replicas, strategy_for

    cpu, env = torch.device("cpu"), from_environ({})

    def made() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return model[0](batch).pow(2).mean()  # model[1] gets no gradient

    batches = [torch.arange(8.0).view(2, 4), torch.ones(2, 4)]
    model, optimizer = made()
    parallel = strategy_for(TrainConfig(), env, cpu).setup(
        model, False, "fp32", lambda: optimizer, torch.amp.GradScaler("cpu", enabled=False)
    )
    total = parallel.backward(loss, batches)
    norm = parallel.clip(0.5)
    skipped = parallel.update(torch.tensor(False))
    assert parallel.unused_parameters(False) == [] and not bool(skipped)
    assert all(p.grad is None for p in model.parameters())

    plain, plain_optimizer = made()
    expected = sum(loss(plain, b) / 2 for b in batches)
    expected.backward()
    expected_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
    plain_optimizer.step()
    assert torch.equal(total, expected.detach()) and torch.equal(norm, expected_norm)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))

    parallel.backward(loss, batches)
    parallel.strategy = Replicas(TrainConfig(parallel="ddp"), env, cpu)
    assert parallel.unused_parameters(False) == ["1.weight", "1.bias"]
    assert parallel.unused_parameters(True) == []


def autocast_while_computing_loss() -> dict[str, bool]:
    from qgtrain.config import TrainConfig
    from qgtrain.runtime.distributed import process_group
    from qgtrain.runtime.rendezvous import from_environ
    from qgtrain.training.parallel.sharding import find_blocks, shard
    from qgtrain.training.parallel.step import accumulate_gradients
    from qgtrain.training.parallel.strategy import Replicas, Shards

    env, cpu = from_environ(os.environ), torch.device("cpu")
    seen = {}
    with process_group(env, cpu, 60, 60):
        for layout in ("replicated", "sharded"):
            if layout == "replicated":  # DDP around the model, as ddp trains it
                strategy: Any = Replicas(TrainConfig(parallel="ddp"), env, cpu)
                model = strategy.wrap(tiny_gpt2(), False, "bf16")
                assert isinstance(model, DistributedDataParallel)
            else:
                model = tiny_gpt2()
                model = shard(model, find_blocks(model, []), "bf16", cpu)
                strategy = Shards(TrainConfig(parallel="fsdp"), env, cpu)

            def loss(m: torch.nn.Module, ids: torch.Tensor, layout: str = layout) -> torch.Tensor:
                seen[layout] = torch.is_autocast_enabled("cpu")
                return m(input_ids=ids, labels=ids).loss.float()

            ids = torch.randint(0, 200, (2, 16))
            scaler = torch.amp.GradScaler("cpu", enabled=False)
            accumulate_gradients(model, loss, [ids], "bf16", scaler, cpu, strategy=strategy)
    return seen


def test_bf16_autocasts_a_replicated_model_and_leaves_a_sharded_one_to_fsdps_policy():
    """FSDP2's MixedPrecisionPolicy already computes in bf16; autocast on top would cast every
    weight again. Each model is wrapped by its strategy (DDP, FSDP2) on a one-rank group."""
    assert run_ranks(1, autocast_while_computing_loss) == [{"replicated": True, "sharded": False}]


def test_the_built_in_loss_equals_transformers_own_causal_lm_loss():
    from qgtrain.tasks.models import lm_loss

    torch.manual_seed(0)
    model, ids = tiny_gpt2(), torch.randint(0, 200, (3, 16))
    torch.testing.assert_close(lm_loss(model, ids), model(input_ids=ids, labels=ids).loss)


def test_a_factory_model_holding_a_config_is_not_asked_for_use_cache():
    """The built-in loss tells a transformers model use_cache=False; a model of one's own that
    keeps a `config` (as nanoGPT's does) and whose forward takes input_ids alone still trains."""
    from qgtrain.tasks.models import lm_loss

    class OwnLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = {"vocab": 11}
            self.embed = torch.nn.Embedding(11, 11)

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.embed(input_ids)

    lm_loss(OwnLM(), torch.randint(0, 11, (2, 5))).backward()


def test_an_update_from_non_finite_gradients_is_skipped_on_the_device_by_fused_optimizers():
    """Fused AdamW skips in its kernel (no host read of the flag) and takes back its step count;
    another optimizer skips by reading the flag. Either way the weights and the state stay as they
    were."""
    from qgtrain.training.parallel.step import apply_update

    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for fused in (True, False):
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.AdamW(model.parameters(), fused=fused or None)
        assert getattr(optimizer, "_step_supports_amp_scaling", False) == fused
        model(torch.ones(1, 3)).sum().backward()
        before = [p.detach().clone() for p in model.parameters()]
        apply_update(optimizer, scaler, torch.tensor(True))
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert all(state["step"] == 0 for state in optimizer.state.values())
        apply_update(optimizer, scaler, torch.tensor(False))
        assert not any(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert not hasattr(optimizer, "found_inf")


def flags_as_reads_go_by() -> list[tuple[bool, bool, int]]:
    from qgtrain.runtime.distributed import process_group
    from qgtrain.runtime.rendezvous import from_environ
    from qgtrain.training.agreement import Agreement, Flags

    env, cpu = from_environ(os.environ), torch.device("cpu")
    seen = []
    with process_group(env, cpu, 60, 60):
        agreement, ok, bad = Agreement(cpu), torch.tensor(False), torch.tensor(True)
        reads = [(True, ok), (False, ok), (False, bad), (False, ok)]
        for step, (stop, grads) in enumerate(reads, 1):
            agreement.start(Flags(stop_requested=stop and env.rank == 1), torch.tensor(False))
            flags = agreement.read(grads, step)
            seen.append((flags.stop_requested, flags.bad_grads, flags.as_of))
        settled = agreement.settle(ok, 5)
        seen.append((settled.stop_requested, settled.bad_grads, settled.as_of))
        agreement.finish()
    return seen


def test_agreed_flags_reach_the_host_one_read_later_and_settle_waits_for_them():
    """A stop asked on rank 1 before step 1 is agreed by step 2's read and on the host at step 3's,
    on both ranks; non-finite gradients read at step 3 come back at step 4's read, naming step 3."""
    expected = [
        (False, False, 0),
        (False, False, 1),
        (True, False, 2),
        (False, True, 3),
        (False, False, 4),
    ]
    assert run_ranks(2, flags_as_reads_go_by) == [expected, expected]


def fused_update_over_shards() -> tuple[bool, bool]:
    from torch.distributed.fsdp import fully_shard

    from qgtrain.runtime.distributed import process_group
    from qgtrain.runtime.rendezvous import from_environ
    from qgtrain.training.parallel.step import apply_update

    with process_group(from_environ(os.environ), torch.device("cpu"), 60, 60):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), fused=True)
        model(torch.ones(2, 4)).sum().backward()
        before = [p.detach().full_tensor().clone() for p in model.parameters()]
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        apply_update(optimizer, scaler, torch.zeros((), dtype=torch.bool).logical_not())
        unchanged = [torch.equal(a, p.full_tensor()) for a, p in zip(before, model.parameters())]
        apply_update(optimizer, scaler, torch.zeros((), dtype=torch.bool))
        changed = [not torch.equal(a, p.full_tensor()) for a, p in zip(before, model.parameters())]
    return all(unchanged), all(changed)


def test_a_fused_optimizer_over_fsdp_shards_takes_the_skip_flag_as_a_plain_scalar():
    """On GPUs fsdp's parameters are DTensors and the flag a plain 0-dim tensor: DTensor treats a
    one-element tensor as replicated (torch/distributed/tensor/_dispatch.py,
    _try_replicate_spec_for_scalar_tensor)."""
    assert run_ranks(1, fused_update_over_shards) == [(True, True)]


def casts_and_result(micro_batches: list[torch.Tensor], by_qgtrain: bool) -> tuple[int, list]:
    """A bf16 step of two linear layers over the micro-batches, by accumulate_gradients or by the
    plain loop (autocast around each forward): the casts it made, its loss and gradients."""
    from torch.profiler import ProfilerActivity, profile

    from qgtrain.config import TrainConfig
    from qgtrain.runtime.rendezvous import from_environ
    from qgtrain.training.parallel.step import accumulate_gradients
    from qgtrain.training.parallel.strategy import Strategy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    cpu, scaler = torch.device("cpu"), torch.amp.GradScaler("cpu", enabled=False)

    def loss(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(m(x).float(), x.sum(1, keepdim=True))

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        if by_qgtrain:
            strategy = Strategy(TrainConfig(), from_environ({}), cpu)
            total = accumulate_gradients(
                model, loss, micro_batches, "bf16", scaler, cpu, strategy=strategy
            )
        else:
            total = torch.zeros(())
            for x in micro_batches:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    part = loss(model, x) / len(micro_batches)
                part.backward()
                total = total + part.detach().float()
    casts = sum(e.count for e in prof.key_averages() if e.key == "aten::_to_copy")
    return casts, [total, *(p.grad for p in model.parameters())]


def test_a_steps_micro_batches_cast_each_weight_once_with_the_plain_loops_result():
    """Three micro-batches: the plain loop casts the four weights and biases in every forward,
    qgtrain in the first only (precision.weights_cast_once), and the step is the same bit for
    bit."""
    micro_batches = [
        torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)
    ]
    ours, theirs = casts_and_result(micro_batches, True), casts_and_result(micro_batches, False)
    assert theirs[0] - ours[0] == 2 * 4, (ours[0], theirs[0])
    assert all(torch.equal(a, b) for a, b in zip(ours[1], theirs[1]))
    one = casts_and_result(micro_batches[:1], True)
    assert one[0] == casts_and_result(micro_batches[:1], False)[0]
