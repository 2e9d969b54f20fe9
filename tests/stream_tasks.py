"""Tasks whose train split is a stream, named in configs as 'tests.stream_tasks:<function>':
parts of uneven length per rank, worker and epoch, with and without state, a Hugging Face
streaming dataset of local parquet files, and streams that break one rule each (empty, a state
that fails to load)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import IterableDataset, get_worker_info

import qgtrain
from tests.factories import TinyLM
from tests.tasks import Points, classify_loss


class Uneven(IterableDataset):
    """Rank r's worker w yields 8 + 5r + 4w + 4 (epoch % 2) samples in an epoch, each made from its
    own seed, so the parts end at different batches and the epochs differ. No state: a resume reads
    past what was consumed."""

    def __init__(self, scale: int = 1) -> None:
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.scale, self.epoch, self.start, self.yielded = scale, 0, 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Any:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        length = self.scale * (8 + 5 * self.rank + 4 * worker + 4 * (self.epoch % 2))
        start, self.start = self.start, 0
        for index in range(start, length):
            self.yielded = index + 1
            seed = ((self.rank * 16 + worker) * 1000 + self.epoch) * 1000 + index
            x = torch.randn(8, generator=torch.Generator().manual_seed(seed))
            yield {"x": x, "label": (x[:3].sum() > 0).long()}


class StatefulUneven(Uneven):
    """The same stream, which says where it is: resumed from its state, without reading again."""

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "yielded": self.yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.start = state["epoch"], state["yielded"]


class BrokenState(StatefulUneven):
    def load_state_dict(self, state: dict[str, int]) -> None:
        raise ValueError(f"no shard for position {state['yielded']}")


def _task(train: Any) -> qgtrain.Task:
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 2))
    return qgtrain.Task(model=model, train=train, val=Points(24, 2), loss=classify_loss)


def stateless(cfg: qgtrain.RunConfig) -> qgtrain.Task:
    return _task(Uneven())


def stateful(cfg: qgtrain.RunConfig) -> qgtrain.Task:
    return _task(StatefulUneven())


def broken_state(cfg: qgtrain.RunConfig) -> qgtrain.Task:
    return _task(BrokenState())


def empty(cfg: qgtrain.RunConfig) -> qgtrain.Task:
    return _task(Uneven(scale=0))


def hub_parquet(cfg: qgtrain.RunConfig) -> qgtrain.Task:
    """The parquet files of task.options.files (comma-separated), streamed by `datasets`."""
    import datasets

    files = sorted(str(cfg.task.options["files"]).split(","))
    stream = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
    return _task(stream.with_format("torch"))


class RecordingLM(TinyLM):
    """tests.factories' tiny LM that appends the first 6 bytes of every row it trains on (a sample's
    id, in test_stream_files.py's documents) to $QGTRAIN_TEST_IDS-<pid>."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.training and os.environ.get("QGTRAIN_TEST_IDS"):
            with open(f"{os.environ['QGTRAIN_TEST_IDS']}-{os.getpid()}", "a") as out:
                out.writelines(bytes(row[:6].tolist()).decode() + "\n" for row in input_ids)
        return super().forward(input_ids)


def recording_lm(vocab_size: int, seq_len: int) -> nn.Module:
    return RecordingLM(vocab_size)
