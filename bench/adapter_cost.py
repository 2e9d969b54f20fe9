"""Full fine-tuning against LoRA on the same pretrained base and data, in one run: step time, peak
memory, checkpoint size and save time, each a median over alternating `qgtrain train` runs.

The base is a Llama built from a config and saved with save_pretrained (no network), fine-tuned on
the built-in corpus; both sides run the same command but for `model.adapter`. Figures come from what
a user sees: tokens/s and memory from metrics.jsonl, size and write time from the "saved checkpoint"
log lines.
Usage: python -m bench.adapter_cost [--hidden 512] [--layers 8] [--steps 30] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAVED = re.compile(r"saved checkpoint \S+ \(([\d.]+) MB written in ([\d.]+) s\)")


@dataclass
class Figures:
    tokens_per_s: float
    peak_memory_gb: float
    checkpoint_mb: float
    save_s: float


def build_base(folder: Path, hidden: int, layers: int) -> int:
    """A Llama for the byte tokenizer (257 tokens); returns its parameter count."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=257,
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=512,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def train(run: Path, base: Path, steps: int, adapter: str) -> Figures:
    sets = [
        f"model.pretrained={base}",
        f"model.adapter={adapter}",
        f"train.max_steps={steps}",
        "train.log_every=1",
        "train.eval_every=0",
        f"checkpoint.every_steps={max(1, steps // 3)}",
        "data.seq_len=256",
        "train.batch_size=8",
        "data.corpus_mb=2",
        "logging.tensorboard=false",
        f"data.cache_dir={run.parent / 'data'}",
        "early_stopping.patience=0",
    ]
    command = [
        sys.executable,
        "-m",
        "qgtrain",
        "train",
        "--config",
        str(ROOT / "config.yaml"),
        "--run-dir",
        str(run),
        "--set",
        *sets,
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{adapter} run failed:\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    later = [r for r in records if r["step"] > 3 and "tokens_per_s" in r]
    saves = [
        (float(mb), float(s)) for mb, s in SAVED.findall((run / "logs" / "rank_0.log").read_text())
    ]
    memory = [r.get("mem_gpu_peak_gb") or r.get("mem_rss_gb", 0.0) for r in records]
    return Figures(
        statistics.median(r["tokens_per_s"] for r in later),
        max(memory),
        statistics.median(mb for mb, _ in saves),
        statistics.median(s for _, s in saves),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="qgtrain-adapter-bench-") as tmp:
        base = Path(tmp) / "base"
        params = build_base(base, args.hidden, args.layers)
        seen: dict[str, list[Figures]] = {"none": [], "lora": []}
        for repeat in range(args.repeats):
            for adapter in seen:  # alternating, so drift hits both alike
                seen[adapter].append(
                    train(Path(tmp) / f"{adapter}-{repeat}", base, args.steps, adapter)
                )
    print(
        f"base: Llama, {params / 1e6:.1f}M parameters; {args.steps} steps, median of {args.repeats}"
    )
    print("| | full fine-tuning | LoRA | LoRA / full |\n|---|---|---|---|")
    for field, label in (
        ("tokens_per_s", "tokens/s"),
        ("peak_memory_gb", "peak memory (GB)"),
        ("checkpoint_mb", "checkpoint (MB)"),
        ("save_s", "checkpoint write (s)"),
    ):
        full = statistics.median(getattr(f, field) for f in seen["none"])
        lora = statistics.median(getattr(f, field) for f in seen["lora"])
        print(f"| {label} | {full:.3g} | {lora:.3g} | {lora / full:.3f} |")


if __name__ == "__main__":
    main()
