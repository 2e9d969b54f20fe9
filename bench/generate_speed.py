"""Greedy generation of eval.tasks' `generate` kind (evals/scoring.py), the two ways alternated in
one process: each new token forwarded once against the key/value cache (how a transformers model
generates) and the whole window forwarded for each token (any other model's way, and qgtrain's only
way before). A GPT-2 of the given shape with random weights, no end-of-text token, so every row
writes all its tokens. Usage: python -m bench.generate_speed [--hidden 768 --layers 12 --heads 12]
[--window 1024] [--prompt 64] [--new 32] [--rows 8] [--repeats 3] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from bench.common import alternate, report
from qgtrain.evals import scoring


class Bytes:
    """A byte-level codec: the built-in tokenizer's contract (encode(text).ids, decode(ids))."""

    def encode(self, text: str, add_special_tokens: bool = False) -> SimpleNamespace:
        return SimpleNamespace(ids=list(text.encode()))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return bytes(i for i in ids if i < 256).decode(errors="replace")


def main() -> None:
    parser = argparse.ArgumentParser()
    for name, default in (("hidden", 768), ("layers", 12), ("heads", 12), ("window", 1024)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--prompt", type=int, default=64, help="prompt length in tokens")
    parser.add_argument("--new", type=int, default=32, help="tokens written per prompt")
    parser.add_argument("--rows", type=int, default=8, help="prompts, one batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = GPT2Config(
        n_embd=args.hidden,
        n_layer=args.layers,
        n_head=args.heads,
        n_positions=args.window,
        vocab_size=257,
    )
    device = torch.device(args.device)
    module = GPT2LMHeadModel(config).to(device).eval()
    prompts = [("abcdefgh"[row] * args.prompt)[: args.prompt - row] for row in range(args.rows)]

    def way(argument: str | None) -> scoring.Model:
        return scoring.Model(
            module,
            Bytes(),
            None,
            window=args.window,
            device=device,
            precision="fp32",
            batch_size=args.rows,
            lockstep=False,
            cache_argument=argument,
        )

    cached, windowed = way(scoring.cache_argument(module)), way(None)
    times = alternate(
        {
            "with the cache": lambda: scoring.generate(cached, prompts, args.new, []),
            "the whole window": lambda: scoring.generate(windowed, prompts, args.new, []),
        },
        args.repeats,
    )
    report(
        f"{args.rows} prompts of {args.prompt} tokens, {args.new} tokens each, GPT-2 "
        f"{args.layers} x {args.hidden} on {args.device}",
        times,
        "with the cache",
        "the whole window",
        "< 1",
    )


if __name__ == "__main__":
    main()
