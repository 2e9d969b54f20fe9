"""What kind of stream a task's train split is, asked before it is read: a stream at all (an
IterableDataset, read by streams.py instead of a sampler), one with torchdata's Stateful protocol
(its position saved, not replayed), and, for a Hugging Face streaming dataset, this rank's part."""

from __future__ import annotations

from typing import Any

from torch.utils.data import IterableDataset


def is_stream(dataset: Any) -> bool:
    return isinstance(dataset, IterableDataset)


def is_stateful(dataset: Any) -> bool:
    """torchdata's Stateful protocol: the loader saves and restores the dataset through these."""
    return callable(getattr(dataset, "state_dict", None)) and callable(
        getattr(dataset, "load_state_dict", None)
    )


def for_this_rank(dataset: Any, rank: int, world_size: int) -> Any:
    """This rank's part of a Hugging Face streaming dataset (its shards, or every world_size-th
    example); any other stream shards itself. `datasets` is imported only for one of its own."""
    if world_size == 1 or not type(dataset).__module__.startswith("datasets."):
        return dataset
    from datasets import IterableDataset as HubStream
    from datasets.distributed import split_dataset_by_node

    if isinstance(dataset, HubStream):
        return split_dataset_by_node(dataset, rank=rank, world_size=world_size)
    return dataset
