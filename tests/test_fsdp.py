"""FSDP2 and sharded checkpoints. Runs against: real 2- and 3-rank gloo groups (FSDP2 and
torch.distributed.checkpoint work on the CPU), real `qgtrain train` processes SIGKILLed and resumed,
also on other world sizes and in the other parallel mode, and the exported folder loaded by
transformers itself."""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from qgtrain.state import layout
from tests.helpers import (
    assert_resumed_equals,
    checkpoint_state,
    cli,
    kill_once_saved,
    records,
    small_gpt2_run,
    tiny_gpt2,
)
from tests.ranks import run_ranks, start_cli_ranks, wait_ranks


def run_cli(world: int, args: list[str], cwd: Path, prefix: str) -> None:
    codes = wait_ranks(start_cli_ranks(world, args, cwd, log_prefix=prefix), 300)
    assert codes == [0] * world, (
        codes,
        [(cwd / f"{prefix}-{r}.out").read_text()[-3000:] for r in range(world)],
    )


@pytest.mark.slow
def test_fsdp_trains_like_ddp_on_the_same_model_data_and_seed(tmp_path):
    steps = ["train.max_steps=50", "checkpoint.every_steps=0", "train.eval_every=25"]
    run_cli(2, small_gpt2_run(tmp_path / "ddp", *steps), tmp_path, "ddp")
    run_cli(2, small_gpt2_run(tmp_path / "fsdp", *steps, "train.parallel=fsdp"), tmp_path, "fsdp")
    checkpointed = small_gpt2_run(
        tmp_path / "fsdp-ac", *steps, "train.parallel=fsdp", "train.activation_checkpointing=true"
    )
    run_cli(2, checkpointed, tmp_path, "fsdp-ac")
    ddp, fsdp = records(tmp_path / "ddp"), records(tmp_path / "fsdp")
    # recomputed, same
    assert [r["loss"] for r in records(tmp_path / "fsdp-ac")] == [r["loss"] for r in fsdp]
    assert [r["step"] for r in fsdp] == list(range(1, 51))
    log = (tmp_path / "fsdp-0.out").read_text()
    assert "fsdp: sharding 2 GPT2Block blocks and the root over 2 ranks" in log
    assert "returned a view tensor" not in log  # the vocabulary cut runs after FSDP's hook
    for a, b in zip(ddp, fsdp):  # the same sums in another order: fp32 rounding, nothing more
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), a["step"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3), a["step"]
    assert fsdp[-1]["val_loss"] == pytest.approx(ddp[-1]["val_loss"], rel=1e-4)
    assert fsdp[-1]["loss"] < 0.8 * fsdp[0]["loss"]


def memory_per_rank(parallel: str) -> tuple[int, int]:
    """Elements of parameters and of optimizer state this rank holds after one step."""
    from qgtrain.config import OptimConfig, TrainConfig
    from qgtrain.runtime.distributed import process_group
    from qgtrain.runtime.rendezvous import from_environ
    from qgtrain.training.optimizers import adamw
    from qgtrain.training.parallel.sharding import local_numel
    from qgtrain.training.parallel.strategy import strategy_for

    env, cpu = from_environ(os.environ), torch.device("cpu")
    with process_group(env, cpu, 60, 60):
        torch.manual_seed(0)
        model = tiny_gpt2()
        wrapped = strategy_for(TrainConfig(parallel=parallel), env, cpu).wrap(model, False, "fp32")
        optimizer = adamw(model, OptimConfig(), cpu)
        ids = torch.randint(0, 200, (2, 16))
        wrapped(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        states = [v for state in optimizer.state.values() for v in state.values() if v.dim()]
        return local_numel(list(model.parameters())), local_numel(states)


def test_fsdp_holds_about_half_the_parameters_and_optimizer_state_of_ddp_on_two_ranks():
    ddp, fsdp = run_ranks(2, memory_per_rank, "ddp"), run_ranks(2, memory_per_rank, "fsdp")
    # a full replica: AdamW keeps two moments
    assert ddp[0] == ddp[1] and ddp[0][1] == 2 * ddp[0][0]
    for rank in range(2):
        params, states = (fsdp[rank][i] / ddp[rank][i] for i in range(2))
        assert 0.45 <= params <= 0.56 and 0.45 <= states <= 0.56, fsdp
    assert sum(f[0] for f in fsdp) >= ddp[0][0]  # the shards cover the model (padding aside)


KILLED_SETS = ["train.max_steps=24", "train.parallel=fsdp", "model.dropout=0.1"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """The run the killed ones must end as, trained once for both kinds of save (which do not
    change training)."""
    tmp = tmp_path_factory.mktemp("fsdp-reference")
    run_cli(2, small_gpt2_run(tmp / "reference", *KILLED_SETS), tmp, "ref")
    return tmp / "reference"


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True])
def test_sigkill_then_resume_under_fsdp_equals_the_uninterrupted_run(
    uninterrupted, tmp_path, async_save
):
    seed = int(os.environ.get("QGTRAIN_TEST_SEED", time.time()))
    kill_at = random.Random(seed).randrange(6, 20)
    run = tmp_path / "killed"
    killed = small_gpt2_run(run, *KILLED_SETS, f"checkpoint.async_save={str(async_save).lower()}")
    procs = start_cli_ranks(2, killed, tmp_path, log_prefix="killed")
    kill_once_saved(run, procs, kill_at)
    run_cli(2, killed, tmp_path, "killed")
    context = f"(seed {seed}: killed at step {kill_at})"
    assert_resumed_equals(uninterrupted, run, context, max_steps=24)
    saved = checkpoint_state(run / "checkpoints" / "step-24")
    assert any(k.startswith("optim.") for k in saved), "the optimizer's shards are compared too"
    assert "resumed from" in (run / "logs" / "rank_0.log").read_text(), context


@pytest.mark.slow
def test_resume_on_other_world_sizes_and_across_ddp_and_fsdp(tmp_path):
    """fsdp on 2 ranks, then 1 rank (no sharding), fsdp on 3, ddp on 2: each start reshards the last
    one's checkpoint; 12 samples a step on 2 ranks keeps every data position divisible by the next
    world size."""
    # each phase raises train.max_steps: a rate that does not move
    constant = "optim.schedule=constant"
    run_cli(
        2,
        small_gpt2_run(
            tmp_path / "reference", "train.max_steps=24", "train.parallel=fsdp", constant
        ),
        tmp_path,
        "ref",
    )
    run = tmp_path / "run"
    phases = [(2, "fsdp", 12), (1, "fsdp", 16), (3, "fsdp", 20), (2, "ddp", 24)]
    for world, mode, until in phases:
        args = small_gpt2_run(run, f"train.max_steps={until}", f"train.parallel={mode}", constant)
        run_cli(world, args, tmp_path, f"{mode}{world}")
        # as this layout left it, for the probes below
        shutil.copytree(run, tmp_path / f"at-{until}")
    log = (run / "logs" / "rank_0.log").read_text()
    for step, (world, _, _) in zip((12, 16, 20), phases[1:]):
        assert f"resumed from {run}/checkpoints/step-{step}: step {step}" in log
        assert (
            f"resuming a {phases[[p[2] for p in phases].index(step)][0]}-rank checkpoint on "
            f"{world} ranks" in log
        )
    got, expected = records(run), records(tmp_path / "reference")
    assert [r["step"] for r in got] == list(range(1, 25))
    # other batch sizes, the same model: close, not equal
    for mine, theirs in zip(got[12:], expected[12:]):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=0.1), mine["step"]
    state = json.loads((run / "checkpoints" / "step-24" / "state.json").read_text())
    assert state["trainer"]["samples_in_epoch"] == 12 * 12 + 4 * 6 + 4 * 18 + 4 * 12
    # the names layout.py declares, no others
    for step, world, sharded in ((20, 3, True), (24, 2, False)):
        folder = run / "checkpoints" / layout.step_folder(step)
        assert {p.name for p in folder.iterdir()} == layout.top_level(
            world, sharded, ema=False, hf_config=True
        )
    shards = {
        p.name for p in (run / "checkpoints" / layout.step_folder(20) / layout.SHARDED).iterdir()
    }
    assert {f"{layout.SHARDED}/{name}" for name in shards} == {layout.SHARDED_METADATA} | {
        f"{layout.SHARDED}/__{rank}_0.distcp" for rank in range(3)
    }
    # The weights each layout loads are exactly the saved ones: a step at learning rate 0 from the
    # 2-rank shards of step 12 on 3 fsdp ranks, and from the 3-rank shards of step 20 on 2 ddp
    # ranks, saves them back.
    for saved, world, mode in ((12, 3, "fsdp"), (20, 2, "ddp")):
        probe = tmp_path / f"at-{saved}"
        want = checkpoint_state(probe / "checkpoints" / f"step-{saved}")
        run_cli(
            world,
            small_gpt2_run(
                probe,
                f"train.max_steps={saved + 1}",
                f"train.parallel={mode}",
                "optim.lr=0",
                "optim.min_lr=0",
            ),
            tmp_path,
            "probe",
        )
        have = checkpoint_state(probe / "checkpoints" / f"step-{saved + 1}")
        assert all(torch.equal(want[k], have[k]) for k in want if k.startswith("model.")), (
            saved,
            world,
            mode,
        )


@pytest.mark.slow
def test_export_of_an_fsdp_run_gathers_the_full_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    run_cli(2, small_gpt2_run(run, "train.max_steps=8", "train.parallel=fsdp"), tmp_path, "fsdp")
    out = cli("export", str(run), "--out", str(tmp_path / "hf"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    saved = checkpoint_state(run / "checkpoints" / "step-8")
    assert model.config.vocab_size == 257  # the padded vocabulary exported with its real rows
    for name, tensor in model.state_dict().items():
        trained = saved[f"model.{name}"]
        real = trained[:257] if trained.shape[0] == 320 else trained
        assert torch.equal(tensor, real), name


@pytest.mark.slow
def test_fsdp_without_blocks_to_shard_and_incomplete_shards_are_explained(tmp_path):
    procs = start_cli_ranks(
        2,
        small_gpt2_run(
            tmp_path / "noblocks",
            "train.parallel=fsdp",
            "train.max_steps=2",
            "model.factory=tests.factories:tiny",
        ),
        tmp_path,
        log_prefix="noblocks",
    )
    assert wait_ranks(procs, 300) == [2, 2]
    said = (tmp_path / "noblocks-0.out").read_text()
    assert (
        "train.shard_modules: TinyLM does not name its blocks (it has no _no_split_modules); list "
        "the class names of its repeated blocks"
        in said
        and "Traceback" not in said
    )

    run = tmp_path / "run"
    run_cli(2, small_gpt2_run(run, "train.max_steps=8", "train.parallel=fsdp"), tmp_path, "first")
    (run / "checkpoints" / "step-8" / "sharded" / "__1_0.distcp").unlink()
    run_cli(2, small_gpt2_run(run, "train.max_steps=10", "train.parallel=fsdp"), tmp_path, "again")
    log = (run / "logs" / "rank_0.log").read_text()
    assert (
        "step-8/sharded/__1_0.distcp cannot be read" in log
        and f"resumed from {run}/checkpoints/step-4" in log
    )


def saved_activation_bytes(checkpointed: bool) -> tuple[int, dict[str, torch.Tensor]]:
    """Bytes autograd keeps from one forward of a GPT-2 for backward, and the gradients that
    backward gives."""
    from qgtrain.config import ModelConfig, RunConfig, TrainConfig
    from qgtrain.runtime import rng
    from qgtrain.runtime.rendezvous import DistEnv
    from qgtrain.tasks.models import build_model
    from qgtrain.training.parallel.strategy import strategy_for
    from qgtrain.training.transforms import transformed

    rng.seed_everything(0)
    model = build_model(ModelConfig(layers=2, heads=2, hidden=32, dropout=0.1), 257, 16, 256)
    model.train()
    cfg = RunConfig(train=TrainConfig(activation_checkpointing=checkpointed))
    cpu = torch.device("cpu")
    strategy = strategy_for(cfg.train, DistEnv(), cpu)
    strategy.wrap(transformed(model, cfg, strategy), False, "fp32")
    kept: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        kept.append(tensor.numel() * tensor.element_size())
        return tensor

    ids = torch.randint(0, 257, (8, 16), generator=torch.Generator().manual_seed(1))
    # dropout: checkpointing replays the same random numbers in the recomputation
    torch.manual_seed(3)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return sum(kept), {name: p.grad for name, p in model.named_parameters()}


def test_activation_checkpointing_keeps_less_for_backward_and_gives_the_same_gradients():
    plain_bytes, plain_grads = saved_activation_bytes(False)
    checkpointed_bytes, checkpointed_grads = saved_activation_bytes(True)
    assert checkpointed_bytes < 0.6 * plain_bytes, (checkpointed_bytes, plain_bytes)
    assert plain_grads.keys() == checkpointed_grads.keys()
    assert all(torch.equal(plain_grads[k], checkpointed_grads[k]) for k in plain_grads)


def gradients_between_micro_batches(layout: str) -> dict[str, Any]:
    """Between two micro-batches of one step: how many elements of unsharded gradient the FSDP units
    hold (FSDP2's own bookkeeping: FSDPParam.unsharded_accumulated_grad, or the unsharded
    parameter's .grad kept for later), and after the step each rank's reduced gradient shards."""
    from torch.distributed.fsdp import FSDPModule

    from qgtrain.config import TrainConfig
    from qgtrain.runtime.distributed import process_group
    from qgtrain.runtime.mesh import two_d_mesh
    from qgtrain.runtime.rendezvous import from_environ
    from qgtrain.training.parallel.sharding import find_blocks, shard
    from qgtrain.training.parallel.step import accumulate_gradients
    from qgtrain.training.parallel.strategy import GroupShards, Shards

    def unsharded_held(m: torch.nn.Module) -> int:
        held = 0
        for unit in (u for u in m.modules() if isinstance(u, FSDPModule)):
            group = unit._get_fsdp_state()._fsdp_param_group
            for param in group.fsdp_params if group else []:
                unsharded = getattr(param, "_unsharded_param", None)
                for grad in (param.unsharded_accumulated_grad, getattr(unsharded, "grad", None)):
                    held += grad.numel() if grad is not None else 0
        return held

    env, cpu = from_environ(os.environ), torch.device("cpu")
    seen: dict[str, Any] = {}
    with process_group(env, cpu, 60, 60):
        torch.manual_seed(0)
        model = tiny_gpt2()
        mesh = two_d_mesh([[0], [1]], "cpu", 60) if layout == "hsdp" else None
        model = shard(model, find_blocks(model, []), "fp32", cpu, mesh)

        def loss(m: Any, ids: torch.Tensor) -> torch.Tensor:
            seen.setdefault("held", []).append(unsharded_held(m))
            # the reduce-scatter's output FSDP2 keeps back while the all-reduce across replicas
            # waits (FSDPParamGroup._partial_reduce_output): this rank's own gradient, unreduced
            waiting = [
                group._partial_reduce_output.sum()
                for unit in m.modules()
                if isinstance(unit, FSDPModule)
                and (group := unit._get_fsdp_state()._fsdp_param_group) is not None
                and group._partial_reduce_output is not None
            ]
            seen.setdefault("waiting", []).append(float(sum(waiting)) if waiting else None)
            return m(input_ids=ids, labels=ids).loss

        torch.manual_seed(1 + env.rank)  # each rank its own data: unreduced gradients would differ
        batches = [torch.randint(0, 200, (2, 16)) for _ in range(2)]
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        kind = GroupShards if layout == "hsdp" else Shards
        strategy = kind(TrainConfig(parallel=layout), env, cpu)
        accumulate_gradients(model, loss, batches, "fp32", scaler, cpu, strategy=strategy)
        seen["grads"] = [p.grad.full_tensor() for p in model.parameters()]
    return seen


@pytest.mark.parametrize("layout", ["fsdp", "hsdp"])
def test_accumulation_holds_no_unsharded_gradient_between_micro_batches(layout):
    """fsdp reduce-scatters every micro-batch and hsdp postpones only the all-reduce across replicas
    (here 2 replicas of 1 rank), so between micro-batches no unit keeps a full-size gradient (4
    bytes x every parameter on every GPU otherwise), and under hsdp each replica still holds its own
    gradient then (the ranks' data differ); the step's gradient is reduced over both ranks in the
    end."""
    ranks = run_ranks(2, gradients_between_micro_batches, layout)
    for seen in ranks:
        assert seen["held"] == [0, 0]
    for first, second in zip(ranks[0]["grads"], ranks[1]["grads"]):
        assert torch.equal(first, second)
    waiting = [seen["waiting"] for seen in ranks]
    if layout == "fsdp":  # every micro-batch reduced at once: nothing kept back
        assert waiting == [[None, None]] * 2
    else:  # after the first micro-batch each replica holds its own gradient (their data differ)
        assert waiting[0][0] is None and waiting[1][0] is None
        assert None not in (waiting[0][1], waiting[1][1]) and waiting[0][1] != waiting[1][1]
