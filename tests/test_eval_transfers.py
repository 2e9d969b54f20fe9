"""What evaluation and batch moving copy to the device: Python numbers a task reports are summed on
the host (no tensor, so no blocking host-to-device copy, per batch), and objects that move
themselves are asked for non-blocking copies where their `.to` takes it. Runs against: a real
one-rank gloo group evaluating a real model, with torch.as_tensor counted; batch classes recording
how they were moved."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from qgtrain.data.batches import takes_non_blocking, to_device
from tests.ranks import run_ranks


def evaluate_with_python_numbers(size: int, batch_size: int) -> dict[str, Any]:
    from qgtrain.data.loaders import EvalShard, make_loader
    from qgtrain.runtime.distributed import process_group
    from qgtrain.runtime.rendezvous import from_environ
    from qgtrain.training.evaluation import evaluate
    from tests.tasks import Points, classify_loss

    def metrics(
        model: torch.nn.Module, batch: dict[str, torch.Tensor]
    ) -> dict[str, tuple[Any, Any]]:
        labels = batch["label"].tolist()
        return {
            "ones": (sum(labels), len(labels)),
            "share": (0.5 * len(labels), float(len(labels))),
            "right": ((model(batch["x"]).argmax(1) == batch["label"]).sum(), len(labels)),
        }

    env = from_environ(os.environ)
    made = []
    real = torch.as_tensor

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        made.append(type(args[0]).__name__)
        return real(*args, **kwargs)

    with process_group(env, torch.device("cpu"), 60, 60):
        torch.manual_seed(0)
        data = Points(size, 5)
        shard = EvalShard(data, env)
        loader = make_loader(data, shard, batch_size, 0, torch.device("cpu"), 0, False)
        torch.as_tensor = counted
        try:
            result = evaluate(
                torch.nn.Linear(8, 2),
                loader,
                classify_loss,
                metrics,
                torch.device("cpu"),
                "fp32",
                0,
            )
        finally:
            torch.as_tensor = real
    labels = [int(data[i]["label"]) for i in range(size)]
    return {"result": result, "made": made, "ones": sum(labels)}


def test_python_numbers_from_a_task_s_metrics_are_summed_on_the_host():
    seen = run_ranks(1, evaluate_with_python_numbers, 10, 4)[0]
    assert seen["made"] == ["Tensor"] * 3, (
        "only the tensor metric's sums and no Python number became a tensor"
    )
    assert seen["result"]["ones"] == seen["ones"] / 10 and seen["result"]["share"] == 0.5
    assert 0 <= seen["result"]["right"] <= 1


class Recording:
    """A batch type that moves itself, as PyG's Batch does (BaseData.to(device, *args,
    non_blocking=False))."""

    def __init__(self) -> None:
        self.how: dict[str, Any] | None = None

    def to(self, device: torch.device, *args: str, non_blocking: bool = False) -> Recording:
        self.how = {"device": device, "non_blocking": non_blocking}
        return self


class Plain:
    def __init__(self) -> None:
        self.moved_to: torch.device | None = None

    def to(self, device: torch.device) -> Plain:
        self.moved_to = device
        return self


@dataclasses.dataclass(frozen=True)
class Pair:
    x: torch.Tensor
    n: int


def test_objects_that_move_themselves_are_asked_for_non_blocking_copies_where_they_take_it():
    meta = torch.device("meta")
    own, plain = Recording(), Plain()
    moved = to_device({"graph": own, "plain": plain, "pair": Pair(torch.ones(2), 2)}, meta)
    assert own.how == {"device": meta, "non_blocking": True}
    assert plain.moved_to == meta, "a .to without non_blocking is called as before"
    assert type(moved["pair"]) is Pair and moved["pair"].x.device == meta and moved["pair"].n == 2
    assert takes_non_blocking(torch.nn.Linear(2, 2).to) and not takes_non_blocking(len)


def test_pyg_batches_take_non_blocking():
    from torch_geometric.data import Batch, Data

    batch = Batch.from_data_list([Data(x=torch.ones(3, 2)), Data(x=torch.zeros(2, 2))])
    assert takes_non_blocking(batch.to)
    assert to_device(batch, torch.device("meta")).x.device.type == "meta"
