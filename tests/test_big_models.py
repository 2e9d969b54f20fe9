"""Models too big for one rank: built by rank 0 alone and sent as shards. Runs against: real 4-rank
gloo groups building a transformers GPT-2 and a task's own model through the path training takes,
compared bit for bit with one process's build; peak memory read from /proc."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from qgtrain.config.load import load_config
from tests.helpers import byte_config, checkpoint_state, records, small_gpt2_run
from tests.ranks import run_ranks, train_rank

GPT2 = [
    "model.layers=2",
    "model.hidden=32",
    "model.heads=2",
    "data.name=synthetic",
    "data.seq_len=16",
    "data.synthetic_samples=64",
    "train.parallel=fsdp",
    "train.seed=7",
]
OWN = [
    "task=tests.tasks:drawn_after_model",
    "train.parallel=fsdp",
    "train.shard_modules=[Mixer]",
    "train.seed=7",
]


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
    """One rank: the task built (empty on every rank but 0), sharded and filled; the full weights
    gathered."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from qgtrain.runtime import rng
    from qgtrain.runtime.distributed import process_group
    from qgtrain.runtime.rendezvous import from_environ
    from qgtrain.tasks.build import build_task
    from qgtrain.training.parallel.strategy import strategy_for

    cfg, env, cpu = load_config([], sets), from_environ(os.environ), torch.device("cpu")
    with process_group(env, cpu, 60, 60):
        before = rss()
        rng.seed_everything(cfg.train.seed)
        strategy = strategy_for(cfg.train, env, cpu)
        task = build_task(cfg, empty=strategy.builds_empty(resuming=False))
        drawn = torch.rand(4)  # where the generator stands after the build
        empty = any(p.is_meta for p in task.model.parameters())
        strategy.wrap(task.model, False, "fp32")
        grown = peak_rss() - before
        full = (
            get_model_state_dict(
                task.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
            if gather
            else {}
        )
        return {
            "empty": empty,
            "drawn": drawn,
            "grown": grown,
            "weights": dict(full),
            "split": [float(task.val[i]["x"].sum()) for i in range(5)]
            if isinstance(task.val, list)
            else [],
        }


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
        assert all(torch.equal(r["drawn"], drawn) for r in ranks), (
            "a generator is not where a full build leaves it"
        )
    # the task's split, drawn after its model, is the same
    assert len({tuple(r["split"]) for r in ranks}) == 1


BIG = [
    "model.layers=12",
    "model.hidden=512",
    "model.heads=8",
    "data.name=synthetic",
    "data.seq_len=32",
    "data.synthetic_samples=64",
    "train.parallel=fsdp",
]


def test_no_rank_but_rank_0_holds_the_whole_model_at_start():
    """A 38M-parameter GPT-2 (151 MB in fp32) on 4 ranks: each other rank's peak grows by its shards
    and one full tensor at a time, well under the model; rank 0 builds it whole (which shows the
    measure works)."""
    ranks = run_ranks(4, build_as_training_does, BIG, False, timeout=300)
    model_bytes = 4 * sum(p.numel() for p in build_in_one_process(BIG)[0].values())
    assert model_bytes > 140e6
    assert ranks[0]["grown"] > 0.9 * model_bytes, ranks[0]["grown"]
    for rank in (1, 2, 3):
        assert ranks[rank]["grown"] < 0.6 * model_bytes, (rank, ranks[rank]["grown"], model_bytes)


def test_each_rank_checks_the_files_it_reads_next_and_one_rank_each_of_the_rest():
    from qgtrain.state.verify_ranks import assign

    sharded = {
        "sharded/__0_0.distcp": 90,
        "sharded/__1_0.distcp": 90,
        "sharded/__2_0.distcp": 90,
        "sharded/.metadata": 3,
        "rank-0.pt": 1,
        "rank-1.pt": 1,
        "rank-2.pt": 1,
        "state.json": 1,
    }
    assert assign(sharded, 3) == [
        ["sharded/__0_0.distcp", "rank-0.pt", "sharded/.metadata"],
        ["sharded/__1_0.distcp", "rank-1.pt", "state.json"],
        ["sharded/__2_0.distcp", "rank-2.pt"],
    ]
    # the shards of a rank that no longer exists go to whoever has least to read
    shrunk = assign(sharded, 2)
    assert (
        shrunk[0][:2] == ["sharded/__0_0.distcp", "rank-0.pt"]
        and "sharded/__2_0.distcp" in shrunk[0]
    )
    replicated = {
        "model.pt": 400,
        "optim.pt": 800,
        "rank-0.pt": 1,
        "rank-1.pt": 1,
        "config.yaml": 1,
    }
    assert assign(replicated, 2) == [
        ["rank-0.pt", "optim.pt"],
        ["rank-1.pt", "model.pt", "config.yaml"],
    ]
    # every file once, whatever the count
    assert sorted(sum(assign(replicated, 5), [])) == sorted(replicated)


@pytest.mark.slow
def test_a_damaged_shard_is_found_by_the_rank_that_reads_it_and_every_rank_resumes_the_checkpoint_before(  # noqa: E501 (the test's name, which says what it proves)
    tmp_path,
):
    run = tmp_path / "run"
    sets = [
        *GPT2,
        "train.batch_size=6",
        "train.log_every=1",
        "train.eval_every=0",
        "checkpoint.every_steps=2",
        "logging.tensorboard=false",
    ]
    trained = run_ranks(3, train_rank, load_config([], [*sets, "train.max_steps=4"]), str(run))
    assert [r["exit"] for r in trained] == [0, 0, 0]
    shard = run / "checkpoints" / "step-4" / "sharded" / "__2_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the same size: only a checksum can tell
    shard.write_bytes(bytes(data))
    resumed = run_ranks(3, train_rank, load_config([], [*sets, "train.max_steps=6"]), str(run))
    assert [r["exit"] for r in resumed] == [0, 0, 0]
    log = (run / "logs" / "rank_0.log").read_text()
    assert (
        f"skipping checkpoint step-4: {shard} does not match its checksum" in log
        and "(found by rank 2)" in log
    )
    assert f"resumed from {run}/checkpoints/step-2: step 2" in log
    # steps 3 and 4 trained again, logged once
    assert [r["step"] for r in records(run)] == list(range(1, 7))


def test_hsdp_groups_the_ranks_of_each_node_whatever_their_numbers():
    from qgtrain.foundation.errors import ConfigError
    from qgtrain.runtime.mesh import shard_groups

    # block distribution: one group per node
    assert shard_groups([0, 0, 1, 1], 0) == [[0, 1], [2, 3]]
    assert shard_groups([0, 1, 0, 1], 0) == [[0, 2], [1, 3]]  # cyclic: still one group per node
    assert shard_groups([0, 0, 0, 0], 0) == [[0, 1, 2, 3]]  # one node: one group, fsdp
    assert shard_groups([0, 0, 0, 0, 1, 1, 1, 1], 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert shard_groups([0, 0, 1, 1], 4) == [[0, 1, 2, 3]]
    with pytest.raises(
        ConfigError, match=r"the same number of ranks on every node, but the 2 nodes run 3, 1 ranks"
    ):
        shard_groups([0, 0, 0, 1], 0)
    with pytest.raises(ConfigError, match=r"train.shard_group_size: 3 does not divide the 4 ranks"):
        shard_groups([0, 0, 1, 1], 3)


def pretrained_folder(path: Path, hidden: int = 32) -> Path:
    import transformers

    config = byte_config("gpt2", n_embd=hidden, n_positions=32)
    torch.manual_seed(3)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.mark.slow
def test_a_pretrained_model_under_fsdp_is_read_by_rank_0_alone(tmp_path):
    """Rank 1 sees /dev/null where the weights are (a mount namespace of its own): it could not read
    them if it tried. With a learning rate of 0 the checkpoint after one step holds the pretrained
    weights."""
    from safetensors.torch import load_file

    from tests.ranks import start_cli_ranks, wait_ranks

    folder = pretrained_folder(tmp_path / "pretrained")
    weights = folder / "model.safetensors"
    hide = ["unshare", "-m", "sh", "-c", f'mount --bind /dev/null "{weights}" && exec "$0" "$@"']
    run = tmp_path / "run"
    args = small_gpt2_run(
        run,
        "train.parallel=fsdp",
        f"model.pretrained={folder}",
        "optim.lr=0",
        "optim.min_lr=0",
        "train.max_steps=1",
        "train.eval_every=0",
    )
    codes = wait_ranks(start_cli_ranks(2, args, tmp_path, log_prefix="pre", wrap={1: hide}), 300)
    assert codes == [0, 0], [(tmp_path / f"pre-{r}.out").read_text()[-2000:] for r in range(2)]
    assert (
        "sending every rank its shards of the initial weights"
        in (run / "logs/rank_0.log").read_text()
    )
    saved, trained = load_file(weights), checkpoint_state(run / "checkpoints" / "step-1")
    assert saved and all(
        torch.equal(tensor, trained[f"model.{name}"]) for name, tensor in saved.items()
    )


def refused_on_every_rank(results: list[dict[str, Any]], said: str) -> None:
    """The CLI prints such an error as its one line and exits 2."""
    assert [r["exit"] for r in results] == [2] * len(results), results
    assert all(said in r["error"] and "\n" not in r["error"] for r in results), results


@pytest.mark.slow
def test_hsdp_layouts_and_pretrained_folders_that_cannot_work_are_refused_on_every_rank(tmp_path):
    hsdp = [*GPT2[:-2], "train.parallel=hsdp"]
    nodes_of_2_and_1 = {0: {"LOCAL_RANK": "0"}, 1: {"LOCAL_RANK": "1"}, 2: {"LOCAL_RANK": "0"}}
    refused_on_every_rank(
        run_ranks(
            3,
            train_rank,
            load_config([], hsdp),
            str(tmp_path / "a"),
            env=lambda r: {"LOCAL_WORLD_SIZE": "2", **nodes_of_2_and_1[r]},
        ),
        "hsdp needs the same number of ranks on every node, but the 2 nodes run 2, 1 ranks",
    )
    refused_on_every_rank(
        run_ranks(
            2, train_rank, load_config([], [*hsdp, "train.shard_group_size=3"]), str(tmp_path / "b")
        ),
        "train.shard_group_size: 3 does not divide the 2 ranks",
    )
    folder = pretrained_folder(tmp_path / "pretrained")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "n_embd": 64}))
    misfit = load_config([], [*GPT2, f"model.pretrained={folder}"])
    refused_on_every_rank(
        run_ranks(2, train_rank, misfit, str(tmp_path / "c")),
        f"model.pretrained: {folder / 'model.safetensors'} holds transformer.wte.weight of shape "
        "(257, 32), but the model its config.json describes has (257, 64)",
    )


EXPORT_RSS = """
import json, sys
from qgtrain.ops.export.pipeline import export_run
# code, before the baseline
import transformers.models.gpt2.modeling_gpt2, torch.distributed.checkpoint

def status(key):
    return int(next(l for l in open('/proc/self/status') if l.startswith(key)).split()[1]) * 1024

before = status('VmRSS:')
done = export_run(sys.argv[1], sys.argv[2], dtype='bf16')
print(json.dumps({'grown': status('VmHWM:') - before, 'diff': done.max_logit_diff,
                  'checked': done.tensors_checked}))
"""


@pytest.mark.slow
def test_an_fsdp_run_exports_in_bounded_memory_and_reloads_with_equal_logits(tmp_path):
    """The 151 MB GPT-2 trained one step on 2 fsdp ranks, exported in bf16 by a process that
    measures its own peak: it grows by a few tensors, not by the model; the folder, loaded by
    transformers, gives the logits of the checkpoint's weights rounded to bf16."""
    import subprocess
    import sys

    import transformers
    from safetensors import safe_open

    run, out = tmp_path / "run", tmp_path / "hf"
    cfg = load_config(
        [],
        [
            *BIG,
            "train.max_steps=1",
            "train.eval_every=0",
            "train.batch_size=2",
            "logging.tensorboard=false",
        ],
    )
    assert [r["exit"] for r in run_ranks(2, train_rank, cfg, str(run), timeout=300)] == [0, 0]
    done = subprocess.run(
        [sys.executable, "-c", EXPORT_RSS, str(run), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    state = {
        k.removeprefix("model."): v
        for k, v in checkpoint_state(run / "checkpoints" / "step-1").items()
        if k.startswith("model.")
    }
    model_bytes = 4 * sum(v.numel() for k, v in state.items() if k != "lm_head.weight")
    assert (
        model_bytes > 140e6 and measured["diff"] is None and measured["checked"] == len(state) - 1
    )
    # 41 MB measured: a few tensors, code
    assert measured["grown"] < 0.4 * model_bytes, (measured, model_bytes)
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.get_slice("transformer.wte.weight").get_dtype() == "BF16"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    reference = transformers.AutoModelForCausalLM.from_config(reloaded.config).eval()
    assert reloaded.config.vocab_size == 257  # the padded vocabulary exported with its real rows
    real = {
        k: v[:257] if k in ("transformer.wte.weight", "lm_head.weight") else v
        for k, v in state.items()
    }
    reference.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in real.items()})
    tokens = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=tokens).logits, reference(input_ids=tokens).logits)
