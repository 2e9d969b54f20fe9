"""data.val_files beside data.mix: one fixed validation file, evaluated as the validation set of a
two-source mixture (cached and streamed), while the sources hold out nothing for validation (their
test fractions still apply). Runs against: the built-in causal LM task and the real Trainer at the
unit seam (tests/seam.py), on a one-rank group in this process."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from qgtrain.state.train_state import Outcome
from qgtrain.tasks.build import build_task
from qgtrain.training.evaluation import evaluate
from tests.helpers import mix_setting, records, write_mix_source
from tests.seam import build_trainer, config, one_rank_group

SEQ_LEN = 32


def file_windows(path: Path) -> torch.Tensor:
    """The byte tokenizer's windows of a JSON Lines file: each text's bytes, then end-of-text."""
    ids: list[int] = []
    for line in path.read_text().splitlines():
        ids += [*json.loads(line)["text"].encode(), 256]
    whole = len(ids) // SEQ_LEN * SEQ_LEN
    return torch.tensor(np.array(ids[:whole]).reshape(-1, SEQ_LEN), dtype=torch.int64)


@pytest.mark.parametrize("stream", [False, True])
def test_a_shared_val_file_beside_a_mix_is_the_validation_set(tmp_path, stream):
    write_mix_source(tmp_path / "web.jsonl", 40, 1)
    write_mix_source(tmp_path / "code.jsonl", 20, 2)
    shared = tmp_path / "shared.jsonl"
    write_mix_source(shared, 6, 3)
    cfg = config(
        "data.name=files",
        mix_setting(tmp_path),
        f"data.val_files=['{shared}']",
        f"data.cache_dir={tmp_path / 'cache'}",
        f"data.stream={str(stream).lower()}",
        f"data.seq_len={SEQ_LEN}",
        "data.test_fraction=0.2",
        "model.hidden=32",
        "model.layers=1",
        "train.max_steps=2",
        "train.batch_size=4",
        "train.eval_batches=0",
    )
    expected = file_windows(shared)
    with one_rank_group():
        task = build_task(cfg)
        assert torch.equal(torch.stack(list(task.val)), expected), "exactly the file's windows"
        assert task.test is not None and len(task.test) > 0, "the sources' test fraction applies"
        trainer = build_trainer(tmp_path / "run", task, cfg)
        assert trainer.fit() == Outcome.FINISHED
        loader = torch.utils.data.DataLoader(list(expected), batch_size=4)
        own = evaluate(task.model, loader, task.loss, None, torch.device("cpu"), "fp32", 0)
    assert records(tmp_path / "run")[-1]["val_loss"] == pytest.approx(own["loss"], rel=1e-6)
    if not stream:  # the sources' entries hold nothing out for validation; the file has its own
        metas = [json.loads(p.read_text()) for p in (tmp_path / "cache").glob("*/meta.json")]
        by_file = {Path(m["sources"]["train"][0]["path"]).name: m["tokens"] for m in metas}
        assert sorted(by_file) == ["code.jsonl", "shared.jsonl", "web.jsonl"]
        assert by_file["web.jsonl"]["val"] == by_file["code.jsonl"]["val"] == 0
        shared_tokens = by_file["shared.jsonl"]
        assert shared_tokens["val"] == shared_tokens["test"] == 0
        assert expected.numel() <= shared_tokens["train"] < expected.numel() + SEQ_LEN


@pytest.mark.parametrize("stream", [False, True])
def test_a_shared_val_file_without_one_window_is_one_line_naming_it(tmp_path, stream):
    from qgtrain.foundation.errors import ConfigError
    from qgtrain.tasks import mixture

    write_mix_source(tmp_path / "web.jsonl", 10, 1)
    write_mix_source(tmp_path / "code.jsonl", 10, 2)
    (tmp_path / "tiny.jsonl").write_text('{"text": "hi"}\n')
    data = config(
        "data.name=files",
        mix_setting(tmp_path),
        f"data.val_files=['{tmp_path / 'tiny.jsonl'}']",
        f"data.cache_dir={tmp_path / 'cache'}",
        f"data.seq_len={SEQ_LEN}",
    ).data
    with pytest.raises(ConfigError, match=rf"^data.val_files: fewer than data.seq_len={SEQ_LEN}"):
        if stream:
            mixture.streamed_splits(data, 0)
        else:
            mixture.mixture_splits(data, mixture.prepare_sources(data), 0)
