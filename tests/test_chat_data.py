"""Chat and instruction data: rendered with a real chat template (a BPE tokenizer trained here,
saved by transformers, one template with {% generation %} marks and one without), masked so that the
loss counts only the answers, packed into rows whose samples do not attend to each other (checked on
real gpt2 and llama models), or padded; then real `qgtrain` processes train on it, are SIGKILLed and
resume. Streamed (data.stream), the rows are the cache's, resume from any position, and a bad line
deep in the file stops both ranks in one line."""

from __future__ import annotations

import json
import logging
import random
import re
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from qgtrain.config import DataConfig, ModelConfig
from qgtrain.data import chat
from qgtrain.data.cache import prepare
from qgtrain.data.rows import ChatRows
from qgtrain.foundation.errors import ConfigError
from qgtrain.tasks.models import build_model, lm_loss
from tests.helpers import assert_resumed_equals, cli, kill_once_saved, records, train_command
from tests.ranks import start_cli_ranks, wait_ranks

MARKED = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
PLAIN = MARKED.replace("{% generation %}", "").replace("{% endgeneration %}", "")
# The generation prompt differs from how an answer is rendered: neither marks nor prefixes work.
BROKEN = PLAIN.replace(
    "{{ '<|im_start|>assistant\\n' }}{% endif %}", "{{ '<|im_start|>bot\\n' }}{% endif %}"
)
WORDS = (
    "the rank writes a checkpoint what is shard piece of weights and node resumes loss falls"
).split()
TALK = [
    {"role": "system", "content": "be short"},
    {"role": "user", "content": "what is a shard?"},
    {"role": "assistant", "content": "a piece"},
    {"role": "user", "content": "and a rank?"},
    {"role": "assistant", "content": "it writes"},
]


def tokenizer_folder(folder: Path, template: str | None) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([" ".join(WORDS)] * 4 + ["what is a shard? a piece"] * 4, trainer)
    PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", chat_template=template
    ).save_pretrained(folder)
    return folder


def conversations(count: int, seed: int) -> list[dict]:
    """Learnable talks: the answer repeats the question's words in reverse."""
    rng = random.Random(seed)
    talks = []
    for _ in range(count):
        asked = rng.choices(WORDS, k=rng.randint(2, 6))
        talks.append(
            {
                "messages": [
                    {"role": "user", "content": " ".join(asked)},
                    {"role": "assistant", "content": " ".join(reversed(asked))},
                ]
            }
        )
    return talks


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def data(tmp_path: Path, files: Path, **changes) -> DataConfig:  # type: ignore[no-untyped-def]
    return replace(
        DataConfig(
            name="files",
            files=(str(files),),
            cache_dir=str(tmp_path / "cache"),
            format="chat",
            seq_len=48,
            val_fraction=0.0,
            test_fraction=0.0,
        ),
        **changes,
    )


@pytest.mark.parametrize("template", ["marked", "plain"])
def test_only_the_assistant_tokens_are_trained_token_by_token(tmp_path, template):
    from transformers import AutoTokenizer

    folder = tokenizer_folder(tmp_path / "tok", MARKED if template == "marked" else PLAIN)
    ids, trained = chat.renderer(data(tmp_path, tmp_path, tokenizer=str(folder)), 0)(
        {"messages": TALK}, "talk"
    )
    tok = AutoTokenizer.from_pretrained(folder)
    expected_ids, expected_mask = [], []
    for message in TALK:  # special tokens split the text, so the pieces' tokens are the whole's
        answer = message["role"] == "assistant"
        pieces = [
            (f"<|im_start|>{message['role']}\n", False),
            (message["content"] + "<|im_end|>", answer),
            ("\n", answer and template == "plain"),
        ]  # prefixes end where the next turn starts
        for text, counted in pieces:
            piece = tok(text, add_special_tokens=False)["input_ids"]
            expected_ids += piece
            expected_mask += [counted] * len(piece)
    assert ids.tolist() == expected_ids and trained.tolist() == expected_mask
    assert tok.decode(ids[trained]).startswith("a piece<|im_end|>")


def test_prompt_completion_with_and_without_a_chat_template(tmp_path):
    row = {"prompt": "what is a shard?", "completion": " a piece"}
    folder = tokenizer_folder(tmp_path / "tok", MARKED)
    cfg = data(tmp_path, tmp_path, format="prompt_completion", tokenizer=str(folder))
    with_template = chat.renderer(cfg, 0)(row, "row")
    as_chat = chat.renderer(replace(cfg, format="chat"), 0)(
        {
            "messages": [
                {"role": "user", "content": row["prompt"]},
                {"role": "assistant", "content": row["completion"]},
            ]
        },
        "row",
    )
    assert all(np.array_equal(a, b) for a, b in zip(with_template, as_chat))
    ids, trained = chat.renderer(replace(cfg, tokenizer="byte"), 256)(row, "row")
    assert ids.tolist() == list(b"what is a shard? a piece") + [256]
    assert trained.tolist() == [False] * 16 + [True] * 9


def prepared_rows(  # type: ignore[no-untyped-def]
    tmp_path: Path, rows: list, **changes
) -> tuple[ChatRows, DataConfig]:
    cfg = data(
        tmp_path,
        write_jsonl(tmp_path / "talk.jsonl", rows),
        tokenizer=str(tokenizer_folder(tmp_path / "tok", MARKED)),
        **changes,
    )
    files, _ = prepare.prepare(cfg)
    return ChatRows(files.folder, "train", files.dtype, cfg.seq_len, cfg.packing), cfg


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_packed_row_resets_positions_and_its_samples_do_not_see_each_other(tmp_path, arch):
    talks = conversations(12, 1)
    rows, cfg = prepared_rows(tmp_path, talks, seq_len=96)
    render = chat.renderer(cfg, 0)
    row = rows[0]
    starts = (row["position_ids"] == 0).nonzero().flatten().tolist()
    first, second = (render(talk, "") for talk in talks[:2])
    span = slice(len(first[0]), len(first[0]) + len(second[0]))
    assert starts[:3] == [0, span.start, span.stop], "the first two samples share the first row"
    assert row["position_ids"][span].tolist() == list(range(len(second[0])))
    assert "attention_mask" not in row
    assert row["input_ids"][: span.stop].tolist() == first[0].tolist() + second[0].tolist()
    assert (row["labels"][1 : len(first[0])] != -100).tolist() == first[1][1:].tolist()
    assert row["labels"][0] == -100 and row["labels"][len(first[0])] == -100, (
        "a sample's first token"
    )
    torch.manual_seed(0)
    model = build_model(
        ModelConfig(arch=arch, layers=2, heads=2, hidden=32), 300, cfg.seq_len, 0
    ).eval()
    batch = {k: v[None] for k, v in row.items()}
    with torch.no_grad():
        packed = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits
        alone = model(input_ids=torch.from_numpy(second[0])[None]).logits
        assert torch.isfinite(lm_loss(model, batch))
    torch.testing.assert_close(packed[0, span], alone[0], rtol=1e-5, atol=1e-5)


def test_unpacked_rows_hold_one_sample_each_padded_out_of_the_loss_and_attention(tmp_path):
    talks = conversations(6, 2)
    rows, cfg = prepared_rows(tmp_path, talks, packing=False, seq_len=64)
    render = chat.renderer(cfg, 0)
    assert len(rows) == 6
    for index, talk in enumerate(talks):
        ids, _ = render(talk, "")
        row = rows[index]
        assert row["attention_mask"].tolist() == [1] * len(ids) + [0] * (cfg.seq_len - len(ids))
        assert row["input_ids"][: len(ids)].tolist() == ids.tolist()
        assert (row["labels"][len(ids) :] == -100).all() and (
            row["labels"][: len(ids)] != -100
        ).any()
    torch.manual_seed(0)
    model = build_model(ModelConfig(layers=1, heads=2, hidden=32), 300, cfg.seq_len, 0)
    batch = {k: torch.stack([rows[i][k] for i in range(4)]) for k in rows[0]}
    own = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
    ).loss
    # a mean over the counted tokens, as transformers'
    torch.testing.assert_close(lm_loss(model, batch), own)


def test_long_samples_lose_their_prompt_side_and_are_counted_in_the_log(tmp_path):
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("qgtrain")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    long_question = {
        "messages": [
            {"role": "system", "content": " ".join(WORDS * 4)},
            {"role": "user", "content": "what is a shard?"},
            {"role": "assistant", "content": "a piece of the weights"},
        ]
    }
    no_answer = {"messages": [{"role": "user", "content": "what is a shard?"}]}
    try:
        rows, cfg = prepared_rows(
            tmp_path, [long_question, *conversations(3, 3), no_answer], packing=False, seq_len=64
        )
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert any(
        re.match(
            r"data: 1 of 5 samples truncated to data.seq_len=64 \(from the prompt side\); "
            r"1 dropped",
            line,
        )
        for line in lines
    ), lines
    ids, trained = chat.renderer(cfg, 0)(long_question, "")
    assert len(ids) > cfg.seq_len and len(rows) == 4
    assert rows[0]["input_ids"].tolist() == ids[-cfg.seq_len :].tolist(), (
        "the end (the answer) is kept"
    )
    assert (rows[0]["labels"] != -100).sum() == trained.sum()


def test_chat_is_rendered_on_the_prepare_workers_into_the_same_bytes(tmp_path, monkeypatch):
    """data.prepare_workers renders the records (the costly part) in worker processes, batch by
    batch in order: the cache is byte for byte the one a single process writes. (A chat template's
    rendering is chat.renderer's, tested above; here, the pool and the order.)"""
    from qgtrain.data.cache import prepare_chat

    rendered: list[str] = []  # records this process rendered (spawned workers count apart)
    made = chat.renderer

    def counting(cfg, eos_id):  # type: ignore[no-untyped-def]
        render = made(cfg, eos_id)
        return lambda row, where: rendered.append(where) or render(row, where)

    monkeypatch.setattr(chat, "renderer", counting)
    monkeypatch.setattr(prepare_chat, "BATCH_RECORDS", 16)  # 5 batches, more than in flight
    monkeypatch.setattr(chat, "_renderers", {})
    rows = [{"prompt": f"what is {i}?", "completion": f" {i} is {i % 7}"} for i in range(70)]
    talks = write_jsonl(tmp_path / "talk.jsonl", rows)
    folders = {}
    for workers in (1, 2):  # byte-level: a worker starts without transformers (and torch)
        cfg = data(tmp_path / str(workers), talks, format="prompt_completion", val_fraction=0.2)
        folders[workers] = prepare.prepare(cfg, workers)[0].folder
        assert len(rendered) == (70 if workers == 1 else 0), "2 workers render, not this process"
        rendered.clear()
    names = sorted(p.name for p in folders[1].iterdir())
    assert names == sorted(p.name for p in folders[2].iterdir()) and "val.mask.bin" in names
    for name in names:
        one, two = (folders[w].joinpath(name).read_bytes() for w in (1, 2))
        if name == "meta.json":
            one, two = (
                {k: v for k, v in json.loads(m).items() if k not in ("created", "seconds")}
                for m in (one, two)
            )
        assert one == two, name


@pytest.mark.parametrize(
    "record, expected",
    [
        ({"messages": "hello"}, r"talk.jsonl:2: 'messages' holds str, not a list of messages"),
        (
            {"messages": [{"role": "user"}]},
            r"talk.jsonl:2: message 0 is not an object with 'role' and 'content'",
        ),
        (
            {"messages": [{"role": "robot", "content": "hi"}]},
            r"talk.jsonl:2: message 0 has the unknown role 'robot'; allowed: system, user, "
            r"assistant, tool",
        ),
    ],
)
def test_a_malformed_record_names_its_file_and_line(tmp_path, record, expected):
    files = write_jsonl(tmp_path / "talk.jsonl", [*conversations(1, 4), record])
    with pytest.raises(ConfigError, match=expected):
        prepare.prepare(
            data(tmp_path, files, tokenizer=str(tokenizer_folder(tmp_path / "tok", MARKED)))
        )


def test_templates_that_cannot_mark_answers_and_tokenizers_without_one_exit_2(tmp_path):
    files = write_jsonl(tmp_path / "talk.jsonl", conversations(3, 5))
    with pytest.raises(
        ConfigError,
        match=r"data.tokenizer: the chat template of .*tok cannot mark the assistant's "
        r"tokens for data.format: chat: it has no \{% generation %\} marks",
    ):
        prepare.prepare(
            data(tmp_path, files, tokenizer=str(tokenizer_folder(tmp_path / "tok", BROKEN)))
        )
    with pytest.raises(ConfigError, match=r"data.tokenizer: .*bare has no chat template"):
        prepare.prepare(
            data(tmp_path, files, tokenizer=str(tokenizer_folder(tmp_path / "bare", None)))
        )
    out = cli(
        "data",
        "prepare",
        "--set",
        "data.name=files",
        f"data.files=[{files}]",
        "data.format=chat",
        cwd=tmp_path,
    )
    errors = [line for line in out.stderr.splitlines() if line.startswith("qgtrain: error: ")]
    assert out.returncode == 2 and len(errors) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "data.tokenizer: 'byte' has no chat template; data.format: chat needs" in errors[0]


STEPS = 16


def train_args(tmp_path: Path, run: Path) -> list[str]:
    return train_command(
        run,
        "data.name=files",
        f"data.files=[{tmp_path}/talk.jsonl]",
        "data.format=chat",
        f"data.tokenizer={tmp_path}/tok",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.seq_len=96",
        "data.val_fraction=0.1",
        "data.test_fraction=0.0",
        f"train.max_steps={STEPS}",
        "train.log_every=1",
        "train.eval_every=8",
        "train.eval_batches=2",
        "checkpoint.every_steps=4",
        "model.hidden=32",
        "model.layers=2",
        "model.heads=2",
        "train.batch_size=4",
        "optim.lr=0.01",
        "optim.warmup_steps=2",
        "optim.schedule=constant",
        "logging.tensorboard=false",
    )


def test_two_ranks_lower_the_answer_loss_and_a_killed_run_resumes_bit_for_bit(tmp_path):
    write_jsonl(tmp_path / "talk.jsonl", conversations(400, 6))
    tokenizer_folder(tmp_path / "tok", MARKED)
    reference, run = tmp_path / "reference", tmp_path / "killed"
    assert wait_ranks(
        start_cli_ranks(2, train_args(tmp_path, reference), tmp_path, log_prefix="ref"), 300
    ) == [0, 0]
    expected = records(reference)
    losses = [r["loss"] for r in expected if "loss" in r]
    # 16 steps lower the loss of the answers' tokens (the only ones counted), not learn them: the
    # lowest of the last four, as at optim.lr 0.01 a step may spike and the next ones recover
    # (7.4, 6.3, 3.7, 3.4 in one CI run), and which step depends on the held-out lines; and on the
    # held-out talks, the last validation's loss below the first steps' training loss
    assert min(losses[-4:]) < 0.8 * np.mean(losses[:2]), losses
    assert expected[-1]["val_loss"] < np.mean(losses[:2]), (expected[-1], losses)
    assert "data: 0 of 400 samples truncated" in (reference / "logs" / "rank_0.log").read_text()
    seed = int(time.time())
    kill_at = random.Random(seed).randrange(5, 13)
    procs = start_cli_ranks(2, train_args(tmp_path, run), tmp_path, log_prefix="killed")
    kill_once_saved(run, procs, kill_at)
    assert wait_ranks(
        start_cli_ranks(2, train_args(tmp_path, run), tmp_path, log_prefix="killed"), 300
    ) == [0, 0]
    assert_resumed_equals(reference, run, f"(seed {seed}: killed at step {kill_at})", STEPS)


def pretrained_folder(folder: Path, with_tokenizer: bool) -> Path:
    """A small gpt2 as save_pretrained writes it, with the chat tokenizer beside it or without."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tokenizer_folder(folder, MARKED)
    config = GPT2Config(
        vocab_size=len(AutoTokenizer.from_pretrained(folder)),
        n_positions=128,
        n_embd=32,
        n_layer=1,
        n_head=2,
    )
    GPT2LMHeadModel(config).save_pretrained(folder)
    if not with_tokenizer:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            (folder / name).unlink(missing_ok=True)
    return folder


def test_chat_data_on_a_pretrained_folder_uses_its_tokenizer_without_data_tokenizer(tmp_path):
    """data.tokenizer left at byte: the folder's own tokenizer, chat template included, is the one
    checked and used; a folder without a tokenizer is refused in one line before any data is
    read."""
    write_jsonl(tmp_path / "talk.jsonl", conversations(40, 7))
    args = [
        "train",
        "--set",
        "data.name=files",
        f"data.files=[{tmp_path}/talk.jsonl]",
        "data.format=chat",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.seq_len=64",
        "data.val_fraction=0.0",
        "data.test_fraction=0.0",
        "train.max_steps=2",
        "train.batch_size=2",
        "logging.tensorboard=false",
    ]
    model = pretrained_folder(tmp_path / "model", with_tokenizer=True)
    prepared = cli("data", "prepare", *args[1:], f"model.pretrained={model}", cwd=tmp_path)
    assert prepared.returncode == 0 and "prepared" in prepared.stdout, prepared.stderr
    done = cli(*args, f"model.pretrained={model}", "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert "tokenizing" not in done.stderr, "train reuses what data prepare made"
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"using the tokenizer of model.pretrained ({model})" in done.stderr
    assert [r["step"] for r in records(tmp_path / "run")] == [1, 2]

    bare = pretrained_folder(tmp_path / "bare", with_tokenizer=False)
    out = cli(*args, f"model.pretrained={bare}", "--run-dir", str(tmp_path / "run2"), cwd=tmp_path)
    errors = [line for line in out.stderr.splitlines() if line.startswith("qgtrain: error: ")]
    assert out.returncode == 2 and len(errors) == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"model.pretrained: {bare} has no tokenizer (tokenizer.json)" in errors[0]
    assert not (tmp_path / "run2" / "checkpoints").exists()


@pytest.mark.parametrize("packing", [True, False])
def test_streamed_chat_rows_are_the_cached_rows_and_resume_from_any_position(
    tmp_path, monkeypatch, packing
):
    """One file, nothing held out: the stream's rows (rendered and packed in the reader) are the
    cache's, batch for batch; cut into many shards, a reader put back at any saved state goes on
    as the uninterrupted one; a line without messages is one line naming the file and line."""
    from qgtrain.data.files import shards
    from qgtrain.data.stream import filestream

    files = write_jsonl(tmp_path / "talk.jsonl", conversations(40, 3))
    cfg = data(tmp_path, files, tokenizer=str(tokenizer_folder(tmp_path / "tok", MARKED)))
    cfg = replace(cfg, seq_len=64, packing=packing)
    cached, _ = prepare.prepare(cfg, 1)
    rows = ChatRows(cached.folder, "train", cached.dtype, cfg.seq_len, packing)
    streamed = list(filestream.FileReader(filestream.plan(replace(cfg, stream=True), 0), 0, 1))
    assert len(streamed) == len(rows)
    for index, row in enumerate(streamed):
        assert row.keys() == rows[index].keys()
        assert all(torch.equal(row[key], rows[index][key]) for key in row), index
    monkeypatch.setattr(shards, "SHARD_BYTES", 700)
    plan = filestream.plan(replace(cfg, stream=True, val_fraction=0.2), 0)
    whole = list(filestream.FileReader(plan, 0, 1))
    assert len(plan.shards) > 4 and len(whole) < len(rows), "cut, and some records held out"
    for stop in range(0, len(whole), 3):
        reader = filestream.FileReader(plan, 0, 1)
        head = [row for _, row in zip(range(stop), reader)]
        again = filestream.FileReader(plan, 0, 1)
        again.load_state_dict(reader.state_dict())
        resumed = head + list(again)
        assert len(resumed) == len(whole), stop
        assert all(torch.equal(a[k], b[k]) for a, b in zip(resumed, whole) for k in a), stop
    lines = files.read_text().splitlines()
    files.write_text("\n".join([*lines[:30], '{"text": "hi"}', *lines[30:]]) + "\n")
    with pytest.raises(ConfigError, match=r"talk.jsonl:31: no field 'messages' \(fields there"):
        list(filestream.FileReader(filestream.plan(replace(cfg, stream=True), 0), 0, 1))


STREAM_STEPS = 12


def stream_args(tmp_path: Path, run: Path, steps: int) -> list[str]:
    # optim.lr 0.005: at 0.01 a step may spike, and which one depends on the held-out lines (the
    # stream's hash of the file's path)
    more = ["data.stream=true", "data.num_workers=2", "train.eval_every=6", "optim.lr=0.005"]
    return [*train_args(tmp_path, run), *more, f"train.max_steps={steps}"]


def test_streamed_chat_learns_the_answers_resumes_bit_for_bit_and_refuses_a_bad_line(tmp_path):
    """2 ranks x 2 loader workers stream chat records (rendered in the workers, held out by the
    stream's hash): SIGKILLed at a random step, the run resumes bit for bit; the uninterrupted one,
    taken further, reaches a line without messages: one line naming it, exit 2, and the
    checkpoints it had are left as they were."""
    from qgtrain.data.stream import filestream

    tokenizer_folder(tmp_path / "tok", MARKED)
    talks = conversations(600, 6)
    bad = 400  # read by slot 0 (line k by slot k mod 4) long after step STREAM_STEPS
    while True:  # a line held out would be read at the start: the bad one is a training line
        path = write_jsonl(tmp_path / "talk.jsonl", [*talks[:bad], {"text": "hi"}, *talks[bad:]])
        cfg = data(tmp_path, path, val_fraction=0.1, seq_len=96, stream=True)
        byte = len("".join(json.dumps(talk) + "\n" for talk in talks[:bad]).encode())
        plan = filestream.plan(cfg, 0)
        if plan.split_of(plan.shards[0].source.path, byte) == "train":
            break
        bad += 4
    reference, run = tmp_path / "reference", tmp_path / "killed"
    args = stream_args(tmp_path, reference, STREAM_STEPS)
    assert wait_ranks(start_cli_ranks(2, args, tmp_path, log_prefix="ref"), 300) == [0, 0], (
        tmp_path / "ref-0.out"
    ).read_text()[-3000:]
    losses = [r["loss"] for r in records(reference) if "loss" in r]
    final_val = records(reference)[-1]["val_loss"]
    assert np.mean(losses[-3:]) < 0.9 * np.mean(losses[:2]), losses
    assert final_val is not None and final_val < 0.9 * np.mean(losses[:2]), (final_val, losses)
    seed = int(time.time())
    kill_at = random.Random(seed).randrange(4, 11)
    args = stream_args(tmp_path, run, STREAM_STEPS)
    procs = start_cli_ranks(2, args, tmp_path, log_prefix="killed")
    kill_once_saved(run, procs, kill_at)
    assert wait_ranks(start_cli_ranks(2, args, tmp_path, log_prefix="resumed"), 300) == [0, 0]
    assert_resumed_equals(reference, run, f"(seed {seed}: killed at {kill_at})", STREAM_STEPS)
    assert not list(tmp_path.glob("cache/**/meta.json")), "a stream builds no cache"

    def digests() -> dict[str, bytes]:
        found = (reference / "checkpoints").rglob("*")
        return {str(p): p.read_bytes() for p in found if p.is_file()}

    before = digests()
    args = [*stream_args(tmp_path, reference, 200), "checkpoint.keep_last=50"]  # none rotated
    codes = wait_ranks(start_cli_ranks(2, args, tmp_path, log_prefix="bad"), 300)
    out = (tmp_path / "bad-0.out").read_text()
    errors = [line for line in out.splitlines() if line.startswith("qgtrain: error: ")]
    assert codes[0] == 2 and len(errors) == 1 and "Traceback" not in out, out[-3000:]
    assert f"talk.jsonl:{bad + 1}: no field 'messages' (fields there: text)" in errors[0]
    assert {name: digests()[name] for name in before} == before
