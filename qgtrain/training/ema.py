"""An exponential moving average of the weights (train.ema_decay), for evaluation and export.

After each optimizer step that was applied, ema = d * ema + (1 - d) * weights, starting from the
weights the run starts with (built, pretrained, or sent as shards). The average is kept in fp32 for
every trained parameter and laid out like it: under fsdp it is a DTensor of the parameter's
placement, so a rank holds only its shards' average. A step the optimizer did not take (non-finite
gradients skipped on the device, fp16's loss scaler) moves it by nothing: the update's weight is
chosen on the device from the skip flag, so the loop never waits for the host. torch's multi-tensor
lerp makes the update in place, one pass over the weights and the average and no temporary copy
(with a weight that is a device scalar, CUDA runs it as a kernel per tensor).

With train.ema_decay 0 the class holds nothing and each call returns at once, so the loop calls it
unconditionally. Frozen parameters and buffers are not averaged: they are the model's own."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..state import ema_files
from ..state.stateful import source, source_step
from .parallel.strategy import Strategy

log = logging.getLogger("qgtrain")


class Ema:
    def __init__(self, model: nn.Module, decay: float, strategy: Strategy) -> None:
        self.model, self.decay, self.strategy = model, decay, strategy
        named = model.named_parameters() if decay else iter(())
        trained = [(name, p) for name, p in named if p.requires_grad]
        self._params = [p for _, p in trained]
        with torch.no_grad():
            self.averages = {name: p.detach().to(torch.float32, copy=True) for name, p in trained}
        device = self.strategy.local(self._params[0]).device if trained else torch.device("cpu")
        self._moves = torch.tensor(1.0 - decay, device=device)  # the weight of an applied step
        self._stays = torch.zeros((), device=device)  # of a skipped one

    @torch.no_grad()
    def update(self, skipped: torch.Tensor) -> None:
        """After the optimizer's step; `skipped` is the device flag of a step not taken."""
        if not self._params:
            return
        weight = torch.where(skipped, self._stays, self._moves)
        averages = [self.strategy.local(a) for a in self.averages.values()]
        # the parameters' local tensors are looked up each time: FSDP may replace them (lazy init)
        torch._foreach_lerp_(
            averages,
            [self.strategy.local(p).float() for p in self._params],
            [weight] * len(averages),
        )

    @contextlib.contextmanager
    def in_use(self) -> Iterator[None]:
        """The average in the model's parameters while the block runs (an evaluation), then the
        weights back exactly as they were: each pair is exchanged in place, one tensor's copy at a
        time. A sharded model drops its gathered parameters on both sides, so that no forward
        computes with the other's (FSDP keeps the root's after a forward without backward)."""
        kept = self._swap_in()
        try:
            yield
        finally:
            self._swap_out(kept)

    @torch.no_grad()
    def _swap_in(self) -> list[torch.Tensor | None]:
        self.strategy.release_gathered(self.model)
        kept: list[torch.Tensor | None] = []
        for param, average in zip(self._params, self.averages.values()):
            weights, held = self.strategy.local(param), self.strategy.local(average)
            own = weights.clone()
            weights.copy_(held)
            same = own.dtype == held.dtype
            if same:  # the average keeps the weights meanwhile
                held.copy_(own)
            kept.append(None if same else own)
        return kept

    @torch.no_grad()
    def _swap_out(self, kept: list[torch.Tensor | None]) -> None:
        self.strategy.release_gathered(self.model)
        for param, average, own in zip(self._params, self.averages.values(), kept):
            weights, held = self.strategy.local(param), self.strategy.local(average)
            if own is None:
                own = weights.clone()
                weights.copy_(held)
                held.copy_(own)
            else:  # weights of another dtype than fp32: put back from their copy
                weights.copy_(own)

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's "ema": the average by parameter name, under fsdp this rank's shards
        (none with train.ema_decay 0)."""
        return dict(self.averages) if self._params else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The saved average. A checkpoint without one, of a run that turns EMA on as it resumes,
        starts it from the weights it holds: said, not refused."""
        if not self._params:
            if state_dict:
                log.warning(
                    "train.ema_decay is 0: the EMA of the weights in %s is not used, and "
                    "the checkpoints from now on hold none",
                    source(),
                )
            return
        if state_dict:
            ema_files.fill(self.averages, state_dict, source() / ema_files.FILE)
            return
        log.warning(
            "%s holds no EMA of the weights (saved with train.ema_decay 0): the EMA "
            "starts from its weights, those of step %d",
            source(),
            source_step(),
        )
        with torch.no_grad():
            for param, average in zip(self._params, self.averages.values()):
                self.strategy.local(average).copy_(self.strategy.local(param))
