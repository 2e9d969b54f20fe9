"""An asynchronous save's pinned host buffers are made at start, in the background, not by the first
save on the main thread; a loader's workers are forked only once the save's background thread is
done. Runs against: a real model and torch's AdamW before its first step, the snapshot's allocation
function recorded (a CPU cannot pin: every tensor stands in for a GPU one here), the layout a CPU
run prepares (none), and a real DataLoader worker forked beside a real Checkpointer's thread."""

from __future__ import annotations

import subprocess
import sys
import threading

import torch

from qgtrain.state.host_copy import HostCopy, buffer_specs
from tests.helpers import ROOT


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(11, 6)
        self.mid = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.wte.weight  # tied: saved once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid(self.wte(x)))


def everything_on_a_gpu(tensor: torch.Tensor) -> bool:
    return True


def test_the_buffers_are_pinned_at_start_in_the_background_and_the_first_save_allocates_none():
    torch.manual_seed(0)
    model = Tied()
    # fused: `step` lies with the params
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    calls: list[tuple[str, torch.Size]] = []

    def allocate(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        calls.append((threading.current_thread().name, shape))
        return torch.empty(shape, dtype=dtype)

    snapshot = HostCopy(allocate=allocate, pinned=everything_on_a_gpu)
    layouts = buffer_specs(model, optimizer, True, pinned=everything_on_a_gpu)
    snapshot.prepare(layouts)  # before the optimizer has any state
    model(torch.tensor([1, 2, 3])).sum().backward()
    optimizer.step()  # now the state exists, as at the first save
    state = {"model.pt": model.state_dict(), "optim.pt": {"optimizer": optimizer.state_dict()}}
    first = snapshot.copy(state)
    assert {name for name, _ in calls} == {"qgtrain-pin-buffers"}, (
        "the first save allocated nothing itself"
    )
    # wte (= head), mid.weight, mid.bias; then exp_avg, exp_avg_sq and step for each of the 3
    # parameters
    assert len(calls) == len(layouts) == 3 + 3 * 3
    assert first["model.pt"]["wte.weight"] is first["model.pt"]["head.weight"]
    assert torch.equal(first["model.pt"]["mid.weight"], model.mid.weight)
    moments = first["optim.pt"]["optimizer"]["state"]
    assert all(
        torch.equal(moments[i]["exp_avg"], optimizer.state[p]["exp_avg"])
        for i, p in enumerate(model.parameters())
    )
    snapshot.copy(state)
    assert len(calls) == len(layouts), "later saves reuse the same buffers"


def test_a_cpu_run_and_a_rank_that_saves_no_replicated_state_prepare_nothing():
    model = Tied()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    assert buffer_specs(model, optimizer, True) == [], "nothing is pinned on a CPU"
    assert buffer_specs(model, optimizer, False, pinned=everything_on_a_gpu) == [], (
        "ddp: rank 0 writes the state"
    )
    snapshot = HostCopy(
        allocate=lambda shape, dtype: (_ for _ in ()).throw(AssertionError("pinned on a CPU"))
    )
    snapshot.prepare([])
    copy = snapshot.copy({"w": model.mid.weight.detach()})
    assert torch.equal(copy["w"], model.mid.weight)


def test_an_optimizer_whose_state_is_not_predicted_leaves_it_to_the_first_save():
    model = torch.nn.Linear(4, 4)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert buffer_specs(model, sgd, True, pinned=everything_on_a_gpu) == [
        (torch.Size([4, 4]), torch.float32),
        (torch.Size([4]), torch.float32),
    ]


def test_a_loader_worker_is_forked_only_once_the_checkpoint_thread_in_flight_is_done(tmp_path):
    """A worker forked while an asynchronous save writes would keep, for good, any lock its thread
    held at that instant (foundation/forking.py): starting a loader's workers waits for the save."""
    from qgtrain.config import CheckpointConfig
    from qgtrain.state.checkpointer import Checkpointer
    from tests.seam import ONE_RANK, one_rank_group

    finished = threading.Event()

    def slow_write() -> None:
        threading.Event().wait(0.5)
        finished.set()

    with one_rank_group():
        saver = Checkpointer(tmp_path, "fork", ONE_RANK, CheckpointConfig())
        saver._background(slow_write)
        loader = torch.utils.data.DataLoader(list(range(4)), num_workers=1)
        workers = iter(loader)  # forks the worker
        assert finished.is_set(), "the worker was forked while the save was writing"
        assert [int(b) for b in workers] == [0, 1, 2, 3]
        saver.wait()


def test_a_fork_waits_for_a_save_thread_that_submits_to_a_writer_pool_without_deadlock(tmp_path):
    """The save's writer pool (checkpoint.py) takes concurrent.futures' shutdown lock, which that
    module's own before-fork hook holds during a fork: the wait for the thread must run first,
    however the two modules were imported (here qgtrain's first, the order that would hang)."""
    script = tmp_path / "fork.py"
    script.write_text(
        "import os, threading, time\n"
        "from qgtrain.foundation.forking import finished_before_fork\n"
        "from concurrent.futures import ThreadPoolExecutor\n"
        "def write():\n"
        "    time.sleep(0.5)\n"
        "    with ThreadPoolExecutor(max_workers=1) as pool:\n"
        "        pool.submit(print, 'written', flush=True).result()\n"
        "thread = finished_before_fork(threading.Thread(target=write))\n"
        "thread.start()\n"
        "if (pid := os.fork()) == 0:\n"
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "print('forked', flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=30, cwd=ROOT
    )
    assert done.returncode == 0 and done.stdout.split() == ["written", "forked"], done
