"""Data folders others can write are not a way in: a link a colleague planted in a group data
folder, a FIFO matched by a glob, a save_to_disk folder whose state.json names any path, and a
cache entry that the umask would leave group-writable. Runs against: real `qgtrain data prepare`
processes (tests/helpers.cli) under a real umask, real symbolic links (one made by the real user
`nobody`), real FIFOs and a folder written by Hugging Face datasets' save_to_disk."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest

from qgtrain.data.cache.prepare import prepare
from qgtrain.data.files import sources
from qgtrain.foundation.errors import ConfigError
from tests.helpers import cli, data, documents, one_error_line, write_jsonl

SECRET = "SECRET-MARKER-ed25519-7f3a"


def prepare_cli(tmp_path: Path, *sets: str, umask: str = "") -> subprocess.CompletedProcess[str]:
    """`qgtrain data prepare` of data files into tmp_path/cache, given no more than 60 s: a
    preparation that waits on a FIFO fails the test instead of hanging it."""
    launcher = (
        ("sh", "-c", f'umask {umask}; exec "$0" -m qgtrain "$@"', sys.executable) if umask else ()
    )
    return cli(
        "data",
        "prepare",
        "--set",
        "data.name=files",
        f"data.cache_dir={tmp_path / 'cache'}",
        *sets,
        cwd=tmp_path,
        timeout=60,
        launcher=launcher,
    )


def cached_bytes(cache: Path) -> bytes:
    return (
        b"".join(p.read_bytes() for p in cache.rglob("*") if p.is_file()) if cache.exists() else b""
    )


def planted(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A group data folder with one real file and a colleague's link to the user's secret."""
    secret = tmp_path / "home" / "id_ed25519"
    secret.parent.mkdir()
    secret.write_text(SECRET + "\n")
    folder = tmp_path / "group-data"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", documents(5, 1))
    (folder / "zz.txt").symlink_to(secret)
    return folder, folder / "zz.txt", secret


@pytest.mark.parametrize("named", ["glob", "recursive glob", "folder"])
def test_a_link_planted_in_a_data_folder_is_refused_naming_both_paths(tmp_path, named):
    folder, link, secret = planted(tmp_path)
    pattern = {"glob": f"{folder}/*", "recursive glob": f"{folder}/**/*.*", "folder": str(folder)}
    out = prepare_cli(tmp_path, f"data.files=[{pattern[named]}]")
    line = one_error_line(out)
    assert str(link) in line and os.path.realpath(secret) in line, line
    assert "outside" in line and "data.files" in line, line
    # nothing of the secret reached the cache, as bytes or as the byte tokenizer's uint16 ids
    ids = np.frombuffer(SECRET.encode(), dtype=np.uint8).astype(np.uint16).tobytes()
    written = cached_bytes(tmp_path / "cache")
    assert SECRET.encode() not in written and ids not in written


def test_links_of_ones_own_inside_the_folder_and_a_file_named_itself_are_followed(tmp_path):
    folder, link, secret = planted(tmp_path)
    link.unlink()
    (folder / "b.jsonl").symlink_to("a.jsonl")  # the user's own link, inside the folder
    found = [Path(f.path).name for f in sources.find([str(folder)], "data.files")]
    assert found == ["a.jsonl", "b.jsonl"]
    notes = secret.with_name("notes.txt")
    notes.write_text("mine\n")
    named = tmp_path / "named.txt"
    named.symlink_to(notes)  # the user names it: theirs to name, wherever it leads
    assert [f.path for f in sources.find([str(named)], "data.files")] == [str(notes.resolve())]


@pytest.mark.parametrize("named", ["glob", "folder"])
def test_a_fifo_in_a_data_folder_is_refused_in_one_line_never_waited_on(tmp_path, named):
    folder = tmp_path / "group-data"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", documents(5, 1))
    os.mkfifo(folder / "pipe.jsonl")
    pattern = f"{folder}/*.jsonl" if named == "glob" else str(folder)
    line = one_error_line(prepare_cli(tmp_path, f"data.files=[{pattern}]"))
    assert "pipe.jsonl is a FIFO, not a regular file" in line, line


def test_a_file_swapped_for_a_fifo_after_it_was_found_is_refused_when_opened(tmp_path):
    """The check at expansion is cheap but racy; the one on the opened descriptor is not."""
    path = write_jsonl(tmp_path / "a.jsonl", documents(5, 1))
    (found,) = sources.find([str(path)], "data.files")
    path.unlink()
    os.mkfifo(path)
    outcome: list[BaseException | None] = []

    def read() -> None:
        try:
            list(sources.pieces(found, "text"))
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(30)
    if reader.is_alive():  # unblock the reader stuck in open(), then fail
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("reading the data file waited on a FIFO")
    assert isinstance(outcome[0], ConfigError), outcome
    assert str(outcome[0]).startswith(f"{path} is a FIFO, not a regular file")


@pytest.mark.parametrize("entry", ["/etc/passwd", "other", "../other"])
def test_a_save_to_disk_folder_naming_a_path_outside_it_is_refused(tmp_path, entry):
    from datasets import Dataset

    Dataset.from_dict({"text": ["mine"]}).save_to_disk(str(tmp_path / "saved"))
    Dataset.from_dict({"text": [SECRET]}).save_to_disk(str(tmp_path / "other"))
    (arrow,) = (tmp_path / "other").glob("*.arrow")
    named = {
        "/etc/passwd": "/etc/passwd",
        "other": str(arrow),
        "../other": f"../other/{arrow.name}",
    }
    state_file = tmp_path / "saved" / "state.json"
    state = json.loads(state_file.read_text())
    state["_data_files"][0]["filename"] = named[entry]
    state_file.write_text(json.dumps(state))
    with pytest.raises(ConfigError) as refused:
        prepare(data(tmp_path, tmp_path / "saved"))
    message = str(refused.value)
    assert str(state_file.resolve()) in message and repr(named[entry]) in message, message
    assert "\n" not in message


def test_a_save_to_disk_file_linked_out_of_its_folder_is_refused(tmp_path):
    from datasets import Dataset

    Dataset.from_dict({"text": ["mine"]}).save_to_disk(str(tmp_path / "saved"))
    Dataset.from_dict({"text": [SECRET]}).save_to_disk(str(tmp_path / "other"))
    (arrow,) = (tmp_path / "saved").glob("*.arrow")
    arrow.unlink()
    arrow.symlink_to(next((tmp_path / "other").glob("*.arrow")))
    with pytest.raises(ConfigError, match=r"data.files: .*\.arrow leads to .*other.*, outside"):
        prepare(data(tmp_path, tmp_path / "saved"))


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("name", ["files", "corpus"])
def test_a_cache_entry_is_never_group_writable_and_private_unless_shared(tmp_path, name, shared):
    """Under umask 002 a new entry would be 0775 with 0664 files: any group member could edit the
    tokens the user trains on."""
    path = write_jsonl(tmp_path / "a.jsonl", documents(20, 1))
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("\n".join(documents(20, 2)))
    sets = [f"data.files=[{path}]"] if name == "files" else ["data.name=corpus"]
    sets += [f"data.corpus={tmp_path / 'texts'}", f"logging.shared={str(shared).lower()}"]
    out = prepare_cli(tmp_path, *sets, umask="002")
    assert out.returncode == 0, out.stderr
    entry = Path(out.stdout.split()[1].rstrip(":"))
    assert stat.S_IMODE(entry.stat().st_mode) == (0o750 if shared else 0o700)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in entry.iterdir()}
    assert "meta.json" in modes and "train.bin" in modes
    assert set(modes.values()) == {0o640 if shared else 0o600}, modes


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to make a link as the user nobody")
def test_a_link_owned_by_another_user_is_refused_even_inside_the_folder(tmp_path):
    """Another user's link is theirs to repoint at any time, so it is not followed, wherever it
    leads now."""
    root = Path(tempfile.mkdtemp(prefix="qgtrain-shared-"))  # pytest's tmp_path: nobody can't enter
    try:
        os.chmod(root, 0o777)
        folder = root / "group-data"
        folder.mkdir()
        os.chmod(folder, 0o777)
        write_jsonl(folder / "a.jsonl", documents(5, 1))
        made = subprocess.run(
            ["runuser", "-u", "nobody", "--", "ln", "-s", "a.jsonl", str(folder / "b.jsonl")],
            capture_output=True,
            text=True,
        )
        if made.returncode != 0:
            pytest.skip(f"runuser -u nobody failed: {made.stderr.strip()}")
        assert os.lstat(folder / "b.jsonl").st_uid != 0
        for pattern in (f"{folder}/*.jsonl", str(folder)):
            with pytest.raises(ConfigError) as refused:
                sources.find([pattern], "data.files")
            message = str(refused.value)
            assert f"{folder.resolve()}/b.jsonl is a link owned by nobody" in message, message
            assert f"to {(folder / 'a.jsonl').resolve()}" in message, message
    finally:
        shutil.rmtree(root)
