"""The decisions every rank must share before it takes a step, agreed without making any step wait.

A stop signal may reach one rank, a due time-based checkpoint and the time limit are rank 0's to
see, a checkpoint write may fail on any rank, a loss may turn non-finite on one: each is a flag that
is true everywhere if it is true anywhere (an all-reduce with MAX). Each agreement is started before
a step's forward and read after the backward of the next agreeing step, so its round trip between
ranks runs while the ranks compute: the decisions land one agreement later, and no step waits for
the network.

Nor does a step wait for the host to read them: what is read is copied to the host (pinned memory on
a GPU) and taken at the read after, once a whole step has run. So a decision lands a step later
still, and a GPU is never made to drain its queue. What must not wait a step (an update from
non-finite gradients) is skipped on the device (parallel/step.py's apply_update); before a
checkpoint, everything pending is settled.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..runtime import distributed


@dataclass(frozen=True)
class Flags:
    """One agreement's flags. Each is true on every rank if it was true on any rank when it
    started."""

    stop_requested: bool = False  # a stop signal reached some rank
    checkpoint_due: bool = False  # checkpoint.every_minutes has passed (rank 0's clock)
    # checkpoint.local_every_steps: auto: the node-local tier's interval has passed (rank 0's clock)
    local_due: bool = False
    save_failed: bool = False  # an asynchronous checkpoint write failed on some rank
    # the time limit no longer holds the work before the next agreement (rank 0)
    out_of_time: bool = False
    bad_loss: bool = False  # a loss since the last agreement was non-finite on some rank
    # the reduced gradients were non-finite: the same on every rank, so not agreed
    bad_grads: bool = False
    as_of: int = 0  # the step at whose read these flags were taken

    @property
    def stop(self) -> bool:
        return self.stop_requested or self.out_of_time


HOST_FLAGS = ("stop_requested", "checkpoint_due", "local_due", "save_failed", "out_of_time")
AGREED = len(HOST_FLAGS) + 1  # and bad_loss, which stays on the device
FLAG_NAMES = (*HOST_FLAGS, "bad_loss", "bad_grads")


class Agreement:
    """One agreement in flight at a time: `start` begins the next, `read` gives the one before
    it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # what is known before any agreement
        nothing = torch.zeros(AGREED, dtype=torch.int32, device=device)
        self._in_flight = self._started = lambda: nothing
        self._landing = FlagsOnHost(AGREED + 1, device)
        self._held = Flags()

    def start(self, host: Flags, bad_loss: torch.Tensor) -> None:
        """Start agreeing on what this rank knows now: `host`'s flags (one copy to the device for
        all of them) and `bad_loss`, a device flag read without a host sync."""
        on_host = torch.tensor([getattr(host, name) for name in HOST_FLAGS], dtype=torch.int32)
        flags = torch.cat(
            [on_host.to(self.device, non_blocking=True), bad_loss.reshape(1).to(torch.int32)]
        )
        self._started, self._in_flight = self._in_flight, distributed.any_flags_later(flags)

    def read(self, bad_grads: torch.Tensor, step: int) -> Flags:
        """Send the agreement before the one just started, with this rank's `bad_grads`, to the
        host, and return what the previous read sent (no host sync: it has had a step's time to
        arrive)."""
        flags = torch.cat([self._started(), bad_grads.reshape(1).to(torch.int32)])
        landed = _flags(*self._landing.swap(flags, step))
        held, self._held = self._held, Flags()
        return dataclasses.replace(
            landed, **{name: getattr(landed, name) or getattr(held, name) for name in FLAG_NAMES}
        )

    def hold(self, flags: Flags) -> None:
        """Keep what a read gave for a step that is taken again (its batch was dropped, spikes.py):
        the next read returns it too, so no decision is lost."""
        self._held = flags

    def settle(self, bad_grads: torch.Tensor, step: int) -> Flags:
        """Everything known now, waiting for it: the flags on their way to the host (which the next
        read still returns), with `bad_grads` of this step. Before a checkpoint, which must never
        hold a step that went bad."""
        values, as_of = self._landing.take()
        if not values[-1] and bool(bad_grads):
            values[-1], as_of = 1, step
        return _flags(values, as_of)

    def finish(self) -> None:
        """Complete the agreement in flight: the process group must outlive every collective of
        ours."""
        self._in_flight()


def _flags(values: list[int], as_of: int) -> Flags:
    return Flags(**dict(zip(FLAG_NAMES, map(bool, values))), as_of=as_of)


class FlagsOnHost:
    """A small int32 device tensor's values on the host one swap later: copied without blocking into
    pinned memory on a GPU (a copy from device to pageable memory would wait for the GPU), and
    waited for at the next swap, by which time a step has run and the copy with it. On a CPU it is a
    plain copy."""

    def __init__(self, size: int, device: torch.device) -> None:
        on_gpu = device.type == "cuda"
        self._buffer = torch.zeros(size, dtype=torch.int32, pin_memory=on_gpu)
        self._copied = torch.cuda.Event() if on_gpu else None
        self._as_of = 0

    def swap(self, values: torch.Tensor, step: int) -> tuple[list[int], int]:
        """The values sent by the previous swap (and its step), then start sending `values`."""
        landed = self.take()
        self._buffer.copy_(values, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        self._as_of = step
        return landed

    def take(self) -> tuple[list[int], int]:
        if self._copied is not None:
            self._copied.synchronize()
        return self._buffer.tolist(), self._as_of


class Health:
    """Non-finite values this rank has seen, kept on the device so that watching costs no host sync.

    A loss is this rank's own, so it is agreed (which rank began it goes in the message); reduced
    gradients are the same on every rank, so each rank sees them without agreeing.
    """

    def __init__(self, device: torch.device) -> None:
        self.bad_loss = torch.zeros((), dtype=torch.bool, device=device)
        self.bad_grads = torch.zeros((), dtype=torch.bool, device=device)

    def record(self, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> None:
        self.bad_loss |= ~torch.isfinite(loss)
        if grad_norm is not None:
            self.bad_grads |= ~torch.isfinite(grad_norm)
