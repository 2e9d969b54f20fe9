"""What a causal language model says of text: the log-likelihood of a continuation, the loss of a
text, a greedy continuation of a prompt. Scored as lm-evaluation-harness scores them, so that its
figures and ours agree on the same model and items.

The model is anything that maps input_ids (batch, seq) to logits (the built-in task's contract), run
in batches of right-padded rows: in a causal model a row's own positions never see the padding after
them. A transformers model generates with its key/value cache, its prompts left-padded and masked.
Under a sharded model (fsdp) every forward gathers weights, so every rank runs as many forwards as
the busiest one (`lockstep`), an idle rank forwarding a one-token row whose result it drops.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..runtime import precision as precisions


@dataclass(frozen=True)
class Model:
    """A model as the tasks score it: where it runs, how far it sees, how its text is tokenized."""

    module: nn.Module
    codec: Any  # a tokenizers.Tokenizer: encode(text).ids, decode(ids)
    eos_id: int | None
    window: int  # the most tokens one forward sees (the run's data.seq_len)
    device: torch.device
    precision: str  # what autocast runs in: fp32 for a sharded model (its own mixed precision)
    batch_size: int
    lockstep: bool
    vocab_size: int | None = None  # the tokenizer's: rows an embedding is padded with never count
    cache_argument: str | None = None  # how its forward takes a key/value cache (`cache_argument`)

    def encode(self, text: str) -> list[int]:
        return list(self.codec.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.codec.decode(list(ids), skip_special_tokens=False))

    @torch.no_grad()
    def logits(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """Logits (rows, longest row, vocab) in fp32; a row's positions past its end are padding."""
        longest = max(len(row) for row in rows)
        ids = torch.zeros(len(rows), longest, dtype=torch.long)
        for index, row in enumerate(rows):
            ids[index, : len(row)] = torch.tensor(row, dtype=torch.long)
        with precisions.autocast(self.precision, self.device):
            no_cache = {"use_cache": False} if self.cache_argument else {}
            out = self.module(input_ids=ids.to(self.device), **no_cache)
        logits = out.logits if hasattr(out, "logits") else out
        return logits[..., : self.vocab_size].float()

    @torch.no_grad()
    def next_logits(
        self, ids: torch.Tensor, mask: torch.Tensor, past: Any
    ) -> tuple[torch.Tensor, Any]:
        """The logits (rows, vocab) in fp32 of the token after `ids`, which continue the rows
        `past` holds the keys and values of; `mask` covers both (0: left padding). Returns the
        cache to pass next time."""
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1] :]
        with precisions.autocast(self.precision, self.device):
            out = self.module(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                position_ids=positions.to(self.device),
                use_cache=True,
                **{str(self.cache_argument): past},
            )
        return out.logits[:, -1, : self.vocab_size].float(), out.get(self.cache_argument)


def cache_argument(module: nn.Module) -> str | None:
    """The argument under which `module`'s forward takes and returns a key/value cache, where it is
    a transformers causal LM or a PeftModel around one: `cache`, or `past_key_values` before
    transformers renamed it. None for any other model, which generates by forwarding its window."""
    base = getattr(module, "get_base_model", None)  # a PeftModel's
    inner = base() if callable(base) else module
    if getattr(getattr(inner, "config", None), "use_cache", None) is None:
        return None
    takes = inspect.signature(inner.forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in takes), None)


def continuation_pair(model: Model, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The tokens of the context and of the continuation after it, as lm-eval's _encode_pair cuts
    them: trailing spaces of the context move to the continuation, and the continuation's tokens
    are those of the whole text past the context's (a merge across the seam counts for the
    continuation)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, before = model.encode(context + continuation), model.encode(context)
    if not before and model.eos_id is not None:  # nothing to predict the first token from
        return [model.eos_id], whole
    return before, whole[len(before) :]


def log_likelihoods(model: Model, pairs: Sequence[tuple[list[int], list[int]]]) -> list[float]:
    """The summed log-probability of each continuation after its context, the input cut on the
    left to the window as lm-eval cuts it."""
    rows = [(context + continuation)[-(model.window + 1) :][:-1] for context, continuation in pairs]
    scores: list[float] = []
    for start, logits in _forwards(model, rows):
        for offset in range(logits.shape[0]):
            continuation = pairs[start + offset][1]
            length = len(rows[start + offset])
            picked = logits[offset, length - len(continuation) : length].log_softmax(-1)
            targets = torch.tensor(continuation, device=picked.device).unsqueeze(-1)
            scores.append(float(picked.gather(-1, targets).sum()))
    return scores


def text_loss(model: Model, texts: Sequence[str]) -> tuple[float, int]:
    """(summed negative log-likelihood, tokens predicted) of the texts, each in disjoint windows,
    its first token predicted from the end-of-text token where the tokenizer has one."""
    rows: list[list[int]] = []
    for text in texts:
        tokens = ([model.eos_id] if model.eos_id is not None else []) + model.encode(text)
        rows += [tokens[s : s + model.window + 1] for s in range(0, len(tokens) - 1, model.window)]
    total, count = 0.0, 0
    for start, logits in _forwards(model, [row[:-1] for row in rows]):
        for offset in range(logits.shape[0]):
            row = rows[start + offset]
            targets = torch.tensor(row[1:], device=logits.device)
            predicted = logits[offset, : len(row) - 1]
            total += float(F.cross_entropy(predicted, targets, reduction="sum"))
            count += len(row) - 1
    return total, count


def generate(
    model: Model, prompts: Sequence[str], max_new_tokens: int, stop: Sequence[str]
) -> list[str]:
    """Greedy continuations of the prompts, each ended by the end-of-text token, a stop string (cut
    from it, as lm-eval's `until`) or max_new_tokens; a prompt is cut on the left to leave room. A
    transformers model forwards each new token once, with the cache of those before it (as its
    `generate` does); any other model that maps tokens to logits forwards the whole window for each
    token."""
    keep = max(model.window - max_new_tokens, 1)
    outputs: list[str] = []
    batches = [prompts[i : i + model.batch_size] for i in range(0, len(prompts), model.batch_size)]
    for index in range(_rounds(model, len(batches))):
        batch = batches[index] if index < len(batches) else []
        outputs += _generate_batch(model, batch, keep, max_new_tokens, stop)
    return outputs


def _generate_batch(
    model: Model, prompts: Sequence[str], keep: int, max_new_tokens: int, stop: Sequence[str]
) -> list[str]:
    rows = [model.encode(prompt)[-keep:] or [model.eos_id or 0] for prompt in prompts]
    if model.cache_argument and rows and max_new_tokens < model.window:
        written = _greedy_with_cache(model, rows, max_new_tokens, stop)
    else:
        written = _greedy_by_window(model, rows, max_new_tokens, stop)
    return [_cut(model.decode(ids), stop) for ids in written]


def _greedy_by_window(
    model: Model, rows: list[list[int]], max_new_tokens: int, stop: Sequence[str]
) -> list[list[int]]:
    """The tokens written after each row, each step forwarding every running row's window (an idle
    rank in lockstep forwards one token)."""
    written: list[list[int]] = [[] for _ in rows]
    done = [False] * len(rows)
    for _ in range(max_new_tokens):
        if not _anyone_running(model, not all(done)):
            break
        live = [i for i, finished in enumerate(done) if not finished]
        windows = [(rows[i] + written[i])[-model.window :] for i in live] or [[model.eos_id or 0]]
        logits = model.logits(windows)
        for position, i in enumerate(live):
            token = int(logits[position, len(windows[position]) - 1].argmax())
            _take(model, token, written[i], done, i, max_new_tokens, stop)
    return written


def _greedy_with_cache(
    model: Model, rows: list[list[int]], max_new_tokens: int, stop: Sequence[str]
) -> list[list[int]]:
    """The tokens written after each row: the rows left-padded (masked) so that every row's next
    token is the last column; the first forward reads the prompts, each later one the token each
    row chose, against the cache. A finished row goes on being fed and is not read."""
    longest = max(len(row) for row in rows)
    pad = model.eos_id or 0
    ids = torch.tensor([[pad] * (longest - len(row)) + row for row in rows], dtype=torch.long)
    mask = torch.tensor([[0] * (longest - len(row)) + [1] * len(row) for row in rows])
    written: list[list[int]] = [[] for _ in rows]
    done = [False] * len(rows)
    past = None
    for _ in range(max_new_tokens):
        if not _anyone_running(model, not all(done)):
            break
        logits, past = model.next_logits(ids, mask, past)
        chosen = [int(token) for token in logits.argmax(-1).tolist()]
        for i, token in enumerate(chosen):
            if not done[i]:
                _take(model, token, written[i], done, i, max_new_tokens, stop)
        ids = torch.tensor(chosen, dtype=torch.long).unsqueeze(1)
        mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=mask.dtype)], dim=1)
    return written


def _take(
    model: Model,
    token: int,
    row: list[int],
    done: list[bool],
    i: int,
    max_new_tokens: int,
    stop: Sequence[str],
) -> None:
    """Row i's greedy choice: the end of its text, or one more token written (and perhaps its
    last: max_new_tokens reached, or a stop string now in it)."""
    if token == model.eos_id:
        done[i] = True
        return
    row.append(token)
    done[i] = len(row) == max_new_tokens or _stopped(model, row, stop)


def _stopped(model: Model, ids: list[int], stop: Sequence[str]) -> bool:
    return bool(stop) and any(s in model.decode(ids) for s in stop)


def _cut(text: str, stop: Sequence[str]) -> str:
    """The text before the first stop string it holds."""
    ends = [text.index(s) for s in stop if s in text]
    return text[: min(ends)] if ends else text


def _forwards(model: Model, rows: Sequence[list[int]]) -> Iterator[tuple[int, torch.Tensor]]:
    """(index of the batch's first row, its logits) for each batch of rows, with the idle
    forwards a lockstep needs."""
    starts = list(range(0, len(rows), model.batch_size))
    for index in range(_rounds(model, len(starts))):
        if index < len(starts):
            start = starts[index]
            yield start, model.logits(rows[start : start + model.batch_size])
        else:
            model.logits([[model.eos_id or 0]])


def _rounds(model: Model, own: int) -> int:
    """The batches every rank runs: its own, or in lockstep the busiest rank's."""
    if not model.lockstep:
        return own
    most = torch.tensor([own], device=model.device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most.item())


def _anyone_running(model: Model, running: bool) -> bool:
    """Whether a generation step is taken: while this batch runs, or in lockstep while any rank's
    does."""
    if not model.lockstep:
        return running
    flag = torch.tensor([int(running)], device=model.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
