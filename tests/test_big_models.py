"""Models too big for one rank: built by rank 0 alone and sent as shards. Runs against: real 4-rank gloo
groups building a transformers GPT-2 and a task's own model through the path training takes, compared bit
for bit with one process's build; peak memory read from /proc."""

from __future__ import annotations

import os
from typing import Any

import torch

from qgtrain.configload import load_config
from tests.ranks import run_ranks

GPT2 = ["model.layers=2", "model.hidden=32", "model.heads=2", "data.name=synthetic", "data.seq_len=16",
        "data.synthetic_samples=64", "train.parallel=fsdp", "train.seed=7"]
OWN = ["task=tests.tasks:drawn_after_model", "train.parallel=fsdp", "train.shard_modules=[Mixer]", "train.seed=7"]


def peak_rss() -> int:
    """The process's peak resident memory so far (VmHWM), in bytes."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/self/status")


def rss() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def build_as_training_does(sets: list[str], gather: bool) -> dict[str, Any]:
    """One rank: the task built (empty on every rank but 0), sharded and filled; the full weights gathered."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from qgtrain.runtime import rng
    from qgtrain.runtime.distributed import process_group
    from qgtrain.runtime.rendezvous import from_environ
    from qgtrain.tasks.build import build_task
    from qgtrain.training.initial_shards import builds_empty
    from qgtrain.training.parallel import wrap

    cfg, env, cpu = load_config([], sets), from_environ(os.environ), torch.device("cpu")
    with process_group(env, cpu, 60, 60):
        before = rss()
        rng.seed_everything(cfg.train.seed)
        task = build_task(cfg, empty=builds_empty(cfg.train, env, resuming=False))
        drawn = torch.rand(4)  # where the generator stands after the build
        empty = any(p.is_meta for p in task.model.parameters())
        wrap(task.model, env, cpu, False, cfg.train, "fp32")
        grown = peak_rss() - before
        full = get_model_state_dict(task.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)) \
            if gather else {}
        return {"empty": empty, "drawn": drawn, "grown": grown, "weights": dict(full),
                "split": [float(task.val[i]["x"].sum()) for i in range(5)] if isinstance(task.val, list) else []}


def build_in_one_process(sets: list[str]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    from qgtrain.runtime import rng
    from qgtrain.tasks.build import build_task

    cfg = load_config([], sets)
    rng.seed_everything(cfg.train.seed)
    model = build_task(cfg).model
    return model.state_dict(), torch.rand(4)


def test_the_sharded_start_gives_one_process_build_bit_for_bit_and_the_generators_agree():
    for sets in (GPT2, OWN):
        ranks = run_ranks(4, build_as_training_does, sets, True)
        expected, drawn = build_in_one_process(sets)
        assert [r["empty"] for r in ranks] == [False, True, True, True], sets
        got = ranks[0]["weights"]
        assert got.keys() == expected.keys() and len(got) > 6, sets
        assert all(torch.equal(got[k], expected[k]) for k in expected), sets
        assert all(torch.equal(r["drawn"], drawn) for r in ranks), "a generator is not where a full build leaves it"
    assert len({tuple(r["split"]) for r in ranks}) == 1  # the task's split, drawn after its model, is the same


BIG = ["model.layers=12", "model.hidden=512", "model.heads=8", "data.name=synthetic", "data.seq_len=32",
       "data.synthetic_samples=64", "train.parallel=fsdp"]


def test_no_rank_but_rank_0_holds_the_whole_model_at_start():
    """A 38M-parameter GPT-2 (151 MB in fp32) on 4 ranks: each other rank's peak grows by its shards and one
    full tensor at a time, well under the model; rank 0 builds it whole (which shows the measure works)."""
    ranks = run_ranks(4, build_as_training_does, BIG, False, timeout=300)
    model_bytes = 4 * sum(p.numel() for p in build_in_one_process(BIG)[0].values())
    assert model_bytes > 140e6
    assert ranks[0]["grown"] > 0.9 * model_bytes, ranks[0]["grown"]
    for rank in (1, 2, 3):
        assert ranks[rank]["grown"] < 0.6 * model_bytes, (rank, ranks[rank]["grown"], model_bytes)
