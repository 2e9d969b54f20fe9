"""How a rank uses its CPU. Runs against: fresh interpreters training the main job's model (page
faults counted by the kernel, through getrusage)."""

from __future__ import annotations

import subprocess
import sys

STEPS = """
import resource, sys
import torch
from qgtrain.runtime import cpu, rng
from qgtrain.config import ModelConfig
from qgtrain.tasks.models import build_model, lm_loss
if sys.argv[1] == "keep":
    assert cpu.keep_freed_memory(), "glibc's mallopt refused the settings"
torch.set_num_threads(1)
rng.seed_everything(0)
model = build_model(ModelConfig(), 257, 128, 256)
tokens = torch.randint(0, 257, (8, 128))
def step():
    lm_loss(model, tokens).backward()
    model.zero_grad(set_to_none=True)
for _ in range(5):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(25):
    step()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 25)
"""


def faults_per_step(mode: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", STEPS, mode], capture_output=True, text=True, check=True, timeout=120
    )
    return float(out.stdout.split()[-1])


def test_a_cpu_rank_keeps_freed_memory_instead_of_faulting_it_in_every_step():
    """A step of the main job's model touches ~25 MB of activations. glibc's default gives much of
    it back and faults it in again in most steps; kept, a step reuses its memory.

    Which steps fault, and how much, depends on the machine (on one CPU 500-2000 faults per
    default step, on another half that): the heap still grows now and then under keep while its
    blocks settle, so the first five steps are left out and the mean is over 25 (here 0-30 kept,
    800-1300 default)."""
    kept, default = faults_per_step("keep"), faults_per_step("default")
    assert kept < 200, f"{kept:.0f} page faults per step with keep_freed_memory"
    assert default > max(5 * kept, 200), (
        f"default malloc: {default:.0f} page faults per step, kept: {kept:.0f}"
    )


COLLECTOR = """
import gc, sys
from pathlib import Path
from qgtrain.interface import collector
if sys.argv[2] == "qgtrain":
    collector.quiet_for_a_command()
print(gc.get_threshold()[0])
class Cycle:
    def __del__(self):
        Path(sys.argv[1]).write_text("collected at exit")
cycle = Cycle()
cycle.itself = cycle
del cycle
"""


def test_a_qgtrain_process_collects_less_often_and_does_not_walk_its_heap_at_exit(tmp_path):
    """interface/collector.py: a cycle left at exit is what the interpreter's final collection
    walks the heap for; in a qgtrain process it is not walked (the process is ending), in a plain
    one it is."""
    seen = {}
    for kind in ("plain", "qgtrain"):
        marker = tmp_path / kind
        done = subprocess.run(
            [sys.executable, "-c", COLLECTOR, str(marker), kind], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        seen[kind] = (int(done.stdout), marker.exists())
    (plain, walked), (ours, walked_ours) = seen["plain"], seen["qgtrain"]
    assert walked and not walked_ours, seen
    assert ours == max(7000, plain) > plain, seen  # CPython 3.11's default is 700
