"""The table of what a checkpoint of the loop saves: each stateful part under its name.

The trainer builds this once from its own objects; the checkpointer saves and restores the table
(state/named.py puts each part where state/layout.py PLACES says). Adding a part (a data mixture's
state, say) is an object with state_dict()/load_state_dict() registered here under a name with a
place in PLACES; neither the loop nor the format changes. The order is the order of loading: the
progress and the facts of the save first, since the data position and the random streams are
judged by the world size they were saved with, and the horizon by the step. It is also the order
of entries in a file that parts share (rank-<N>.pt: the random streams, then the position).
"""

from __future__ import annotations

from typing import Any

from ..data.loaders import TrainBatches
from ..data.stream.dispatch import DispatchedBatches
from ..data.stream.streams import StreamBatches
from ..foundation.errors import CheckpointError, ConfigError
from ..runtime.rendezvous import DistEnv
from ..state.stateful import (
    RngState,
    RunFacts,
    ScalerState,
    Stateful,
    every_rank,
    source,
)
from ..state.train_state import ProgressState, TrainState
from .ema import Ema
from .horizon import LearningRate
from .parts import LoopParts, Settings
from .spikes import Spikes


class DataPosition:
    """ "data": where this rank is in the training data. The run's position (epoch, samples of all
    ranks in it) is the train state's; each rank's file keeps it beside its own. On resume it says
    whether this world size can take the position over: a stream's position is its own (data/
    streams.py), which a new world size takes over only where the stream can deal it again."""

    def __init__(self, state: TrainState, facts: RunFacts, env: DistEnv, stream: bool) -> None:
        self.state, self.facts, self.env, self.stream = state, facts, env, stream

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.state.epoch, "samples_in_epoch": self.state.samples_in_epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved, now, state = self.facts.saved_world_size, self.env.world_size, self.state
        if state.samples_in_epoch % now and not self.stream:
            raise CheckpointError(
                f"{source()} was saved by {saved} rank(s) after {state.samples_in_epoch} samples "
                f"of epoch {state.epoch}, which {now} ranks cannot split evenly. HINT: resume "
                f"with {saved} ranks, or from a checkpoint at an epoch boundary"
            )


class StreamState:
    """ "stream": this rank's position in its part of a stream (data/stream/streams.py), or
    under data.dispatch the whole stream's on rank 0 and a mark on the others
    (data/stream/dispatch.py)."""

    def __init__(
        self, batches: StreamBatches | DispatchedBatches, facts: RunFacts, env: DistEnv
    ) -> None:
        self.batches, self.facts, self.env = batches, facts, env

    def state_dict(self) -> dict[str, Any]:
        return self.batches.saved()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Saved by another world size, each rank's part is every rank's: {"ranks": [...]}, for
        a stream that deals them again (data/stream/streams.py refuses one that cannot)."""
        saved = self.facts.saved_world_size
        if saved != self.env.world_size or self._other_workers(state_dict):
            state_dict = {"ranks": every_rank("stream", saved)}
        self.batches.restore(state_dict, source())

    def _other_workers(self, state_dict: dict[str, Any]) -> bool:
        """Saved with another data.num_workers: the reading slots (ranks x workers) changed as
        with another world size, so a stream that deals its slots' positions again (load_merged)
        takes every rank's; any other is refused in one line (torchdata's loader would assert)."""
        if not isinstance(self.batches, StreamBatches):
            return False
        loader = self.batches.loader
        workers, now = saved_workers(state_dict.get("loader")), loader.num_workers
        if workers is None or workers == now:
            return False
        if callable(getattr(loader.dataset, "load_merged", None)):
            return True
        raise ConfigError(
            f"{self.batches.label}: {source()} was saved with data.num_workers={workers}, this "
            f"run has {now}, and the stream cannot deal its workers' positions again (it has no "
            f"load_merged). HINT: resume with data.num_workers={workers}, or set "
            "checkpoint.resume: never"
        )


def saved_workers(loader_state: Any) -> int | None:
    """The loader workers a StatefulDataLoader's state was saved with (None: no such state)."""
    if not isinstance(loader_state, dict):
        return None
    if "_snapshot" in loader_state:
        return int(loader_state["_snapshot"]["_main_snapshot"]["_num_workers"])
    return 0 if "_num_yielded" in loader_state else None


def saved_parts(
    parts: LoopParts,
    settings: Settings,
    env: DistEnv,
    state: TrainState,
    batches: TrainBatches | StreamBatches | DispatchedBatches,
    lr: LearningRate,
    ema: Ema,
    spikes: Spikes,
) -> dict[str, Stateful]:
    parallel = parts.parallel
    model = parallel.model
    facts = RunFacts(model, settings.precision, env)
    stream = not isinstance(batches, TrainBatches)
    table: dict[str, Stateful] = {
        "train_state": ProgressState(state),
        "facts": facts,
        "rng": RngState(facts, env, settings.train.seed, lambda: state.step),
        "data": DataPosition(state, facts, env, stream),
    }
    if not isinstance(batches, TrainBatches):
        table["stream"] = StreamState(batches, facts, env)
    table.update(
        {
            "model": parallel.strategy.model_state(model),
            "optimizer": parallel.strategy.optimizer_state(model, parallel.optimizer),
            "scaler": ScalerState(parallel.scaler),
            "ema": ema,
            "spikes": spikes,
            "horizon": lr,
        }
    )
    return table
