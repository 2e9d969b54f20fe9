"""What qgtrain publishes: no tracker credential in its console, logs, run files or exported folder,
no credential accepted into a config, no exported folder that says where the user's machines are,
run directories private unless shared, no file holding a token (by its name or its text) in the
code snapshot, and `qgtrain runs` and `eval` showing other users' files without letting them drive
the terminal. Runs against: real `qgtrain` processes (train with real W&B offline and MLflow stores,
export, runs, eval, submit with a stand-in sbatch), a real MLflow HTTP client failing on a closed
port, real files and git repositories, and the real filesystem's modes."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from tests.helpers import TINY, cli, one_error_line, stand_in_sbatch, train_command
from tests.ranks import ROOT

PASSWORD = "s3cret-Pa55word"
API_KEY = "0123456789abcdef0123456789abcdef01234567"
# slurm.account, logging.wandb_project: about the user's site
MARKERS = ("acct-marker-7", "project-marker-7")


@pytest.fixture
def umask_022():
    """The umask most clusters give their users, under which a folder is world-readable unless made
    otherwise; the CLI processes a test starts inherit it."""
    before = os.umask(0o022)
    yield
    os.umask(before)


def every_file(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_a_tracker_credential_reaches_no_console_log_run_file_or_export(tmp_path):
    """MLflow reads a password in MLFLOW_TRACKING_URI itself: qgtrain uses the URI but shows it
    masked; WANDB_API_KEY is never shown. The exported model card and qgtrain_model.json, made to be
    published, keep the model's config but not the sections about the user's site (logging, slurm,
    export)."""
    store = tmp_path / "mlstore"
    uri = f"file://alice:{PASSWORD}@localhost{store}"
    run_dir = tmp_path / "runs" / "run"
    done = cli(
        "train",
        "--config",
        str(ROOT / "config.yaml"),
        "--run-dir",
        str(run_dir),
        "--set",
        *TINY,
        "train.max_steps=2",
        "logging.trackers=[wandb, mlflow]",
        f"logging.wandb_project={MARKERS[1]}",
        f"slurm.account={MARKERS[0]}",
        "export.on_finish=true",
        cwd=tmp_path,
        env={"MLFLOW_TRACKING_URI": uri, "WANDB_API_KEY": API_KEY, "WANDB_SILENT": "true"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    console = done.stdout + done.stderr
    for where, text in {"console": console.encode(), **every_file(run_dir)}.items():
        assert PASSWORD.encode() not in text and API_KEY.encode() not in text, where
    assert f"MLFLOW_TRACKING_URI=file://alice:***@localhost{store} from the environment" in console
    assert "logging to mlflow run" in console and list(store.glob("*/*/metrics/loss")), (
        "MLflow got the run"
    )
    exported = every_file(run_dir / "export")
    assert {"README.md", "qgtrain_model.json"} <= set(exported)
    for name, text in exported.items():
        assert not any(marker.encode() in text for marker in MARKERS), name
        assert str(tmp_path).encode() not in text, f"{name} names the user's folders"
    meta = json.loads(exported["qgtrain_model.json"])
    assert set(meta["config"]) == {
        "task",
        "model",
        "data",
        "optim",
        "train",
        "early_stopping",
        "checkpoint",
    }
    assert (
        meta["config"]["model"]["factory"] == "tests.factories:tiny"
        and meta["run"]["checkpoint"] == "step-2"
    )
    assert "factory: tests.factories:tiny" in exported["README.md"].decode()


def test_a_tracker_failure_quoting_its_uri_is_logged_masked(tmp_path, caplog, monkeypatch):
    """A library's error message may quote the URI it failed on, password included (MLflow's
    does)."""
    from qgtrain.config import LoggingConfig
    from qgtrain.training.trackers import open_trackers

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # fail at once on the closed port
    environ = {"MLFLOW_TRACKING_URI": f"http://alice:{PASSWORD}@127.0.0.1:9/"}
    with caplog.at_level("INFO", logger="qgtrain"):
        opened = open_trackers(
            LoggingConfig(trackers=("mlflow",)), tmp_path, "run", {}, environ=environ
        )
    assert opened == [] and "mlflow could not start" in caplog.text
    assert "http://alice:***@127.0.0.1:9/" in caplog.text and PASSWORD not in caplog.text


@pytest.mark.parametrize("how", ["--set", "file"])
@pytest.mark.parametrize(
    "uri, found",
    [
        (f"http://alice:{PASSWORD}@mlflow.example:5000", "a user name and password"),
        (f"https://mlflow.example/?token={PASSWORD}", "the query parameter 'token'"),
    ],
)
def test_a_credential_in_logging_mlflow_uri_is_refused_before_anything_is_written(
    tmp_path, how, uri, found
):
    """In the config it would be copied into config.yaml of the run, its checkpoints, slurm/ and
    sweep tasks, and the tracker's params: MLflow's own variables carry it instead."""
    run_dir = tmp_path / "run"
    given = ["--set", f"logging.mlflow_uri={uri}"]
    if how == "file":
        (tmp_path / "site.yaml").write_text(f"logging:\n  mlflow_uri: '{uri}'\n")
        given = ["--config", str(tmp_path / "site.yaml")]
    done = cli(
        "train",
        *given,
        "--run-dir",
        str(run_dir),
        "--set",
        *TINY,
        "train.max_steps=1",
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr[-2000:]
    assert "logging.mlflow_uri" in done.stderr and found in done.stderr
    names = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
    assert all(name in done.stderr for name in names)
    assert PASSWORD not in done.stdout + done.stderr
    assert not run_dir.exists()


@pytest.mark.parametrize("shared", [False, True])
def test_a_new_run_directory_is_private_unless_shared(tmp_path, umask_022, shared):
    """Under umask 022 every folder is world-readable; a run's config, logs and weights are not for
    everyone on the cluster. logging.shared opens it to the group to read (0750), never to
    writes."""
    run_dir = tmp_path / "runs" / "run"
    done = cli(
        *train_command(
            run_dir,
            *TINY,
            "train.max_steps=1",
            "checkpoint.every_steps=1",
            f"logging.shared={str(shared).lower()}",
        ),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    mode = stat.S_IMODE(run_dir.stat().st_mode)
    assert mode == (0o750 if shared else 0o700), oct(mode)
    assert "open to other users" not in done.stderr


def test_an_existing_run_directory_keeps_its_mode_and_an_open_one_is_named(tmp_path, umask_022):
    """A folder made before (by the user, or an older qgtrain) is not changed behind the user's
    back."""
    from qgtrain.runs.rundir import create

    made = tmp_path / "mine"
    made.mkdir()
    assert "open to other users (mode 0755)" in (create(made, shared=False) or "")
    assert create(made, shared=True) is None and stat.S_IMODE(made.stat().st_mode) == 0o755
    made.chmod(0o750)
    assert create(made, shared=False) is None and stat.S_IMODE(made.stat().st_mode) == 0o750
    assert create(tmp_path / "new" / "run", shared=False) is None
    assert stat.S_IMODE((tmp_path / "new" / "run").stat().st_mode) == 0o700


def test_runs_shows_control_characters_from_a_run_directory_escaped(tmp_path):
    """Anyone who can write a shared run directory writes what `qgtrain runs` shows: escape
    sequences that recolour, clear or retitle the terminal, and lines that pose as other runs, are
    shown as text."""
    run = tmp_path / "runs" / "evil"
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"run_id": "abc"}))
    (run / "status.json").write_text(
        json.dumps(
            {
                "status": "failed",
                "error": "boom\x1b[2J\r\nother-run: finished\u202e",
                "job_id": "7\x1b]0;owned\x07",
                "failures": [
                    {"rank": 0, "node": "n1\x1b[31m", "how": "killed\x9b", "action": "end"}
                ],
            }
        )
    )
    table = cli("runs", str(tmp_path / "runs"), cwd=tmp_path)
    listed = cli("runs", str(tmp_path / "runs"), "--json", cwd=tmp_path)
    assert table.returncode == 0 and listed.returncode == 0, table.stderr + listed.stderr
    for shown in (table.stdout, listed.stdout):
        assert not any(
            ord(c) < 32 and c != "\n" or 0x7F <= ord(c) < 0xA0 or c == "\u202e" for c in shown
        ), shown
    assert "evil: boom\\x1b[2J\\r\\nother-run: finished\\u202e" in table.stdout
    assert "7\\x1b]0;owned\\x07" in table.stdout and "n1\\x1b[31m" in table.stdout
    assert json.loads(listed.stdout)[0]["error"] == "boom\x1b[2J\r\nother-run: finished\u202e"


def token(prefix: str, body: str) -> str:
    """A token of a known form, put together when the test runs: this file's own text holds none,
    so a snapshot of this repository keeps it and no secret scanner flags it."""
    return prefix + body


# what why_left_out calls each kind -> tokens of that kind (AWS's is its documentation's example)
TOKENS = {
    "a Hugging Face token": [token("hf_", "aBcDeFgHiJkLmNoPqRsTuVwXyZaBcDeFgH")],
    "an OpenAI-style API key": [
        token("sk-", "4bC7dE9fG2hJ5kL8mN3pQ6rS1tU4vW7xY0zA2bC5dE8fG1hJ"),
        token("sk-proj-", "Zx9_Yw8-Vu7Ts6Rq5Po4Nm3Lk2Ji1Hg0Fe9Dc8Ba7"),
    ],
    "an AWS access key id": [token("AKIA", "IOSFODNN7EXAMPLE"), token("ASIA", "Y3FZ2QK7M4R1X8WD")],
    "a GitHub token": [
        token(prefix, "A1b2C3d4" * 4 + "E5f6") for prefix in ("ghp_", "gho_", "ghs_", "ghu_")
    ]
    + [token("github_pat_", "11AB2CDEFG0hIjKlMnOpQr_StUvWxYz0123456789")],
    "a Slack token": [token("xoxb-", "2718281828-3141592653-AbCdEfGhIjKlMnOpQrStUv")],
    "a private key": ["-----BEGIN RSA " + "PRIVATE KEY-----\nMIIEowIBAAKCAQEA\n-----END"],
}
EVERY_TOKEN = [(kind, value) for kind, values in TOKENS.items() for value in values]
# innocent names, and how such a file would hold the value
INNOCENT = {
    "env.sh": "export HF_HOME=/scratch/hf\nexport SOME_SETTING={}\n",
    "notes.txt": "for the cluster: {} (ask Bob)\n",
    "config.py": "import os\n\nSETTING = {!r}\nprint(SETTING)\n",
}


@pytest.mark.parametrize("name", INNOCENT)
@pytest.mark.parametrize("kind, value", EVERY_TOKEN, ids=[v[:6] for _, v in EVERY_TOKEN])
def test_a_file_holding_a_token_is_left_out_of_the_snapshot_whatever_its_name(
    tmp_path, name, kind, value
):
    """A token in code is still a token: a .py file is exempt from the names, not from its text."""
    from qgtrain.launch.secretfiles import why_left_out

    path = tmp_path / name
    path.write_text(INNOCENT[name].format(value))
    assert why_left_out(name, path, ()) == f"holds what looks like {kind}"
    assert value not in str(why_left_out(name, path, ()))


@pytest.mark.parametrize(
    "name, left_out",
    [
        ("kaggle.json", True),
        ("hf_token.txt", True),
        ("api_keys.json", True),
        ("openai-apikey", True),
        ("my-api-key.yaml", True),
        ("token", True),
        ("GITHUB_TOKEN.txt", True),
        ("credentials", True),
        (".netrc", True),
        (".pypirc", True),
        (".npmrc", True),
        ("tokenizer.json", False),  # a tokenizer's files are what a model reads
        ("tokenizer_config.json", False),
        ("tokens.py", False),  # code the job imports
        ("api_keys.py", False),
    ],
)
def test_files_named_like_a_credential_are_left_out_by_name(tmp_path, name, left_out):
    from qgtrain.launch.secretfiles import why_left_out

    path = tmp_path / name
    path.write_text("{}\n")
    assert why_left_out(f"conf/{name}", path, ()) == (
        "named like a credential" if left_out else None
    )


# ordinary text and code that looks a little like a token: each is kept
LOOK_ALIKES = [
    "from sklearn import svm\nsk_learn = svm.SVC()\n",
    "task-queue-of-the-cluster-2024-with-a-long-name\n",  # 'sk-' inside a word
    "risk-assessment-model-version-12345678901234\n",
    "sk-learn-compatible-estimator-wrapper-class\n",  # no digit: a kebab-case name
    "HF_TOKEN = os.environ['HF_TOKEN']  # read from the job's environment\n",
    "path = hf_hub_download(repo_id='gpt2', filename='config.json')\n",
    "x = self." + "hf_" + "downloadedmodelcheckpointfolder_name\n",  # continues as an identifier
    "my" + token("hf_", "aBcDeFgHiJkLmNoPqRsTuVwXyZaBcDeFgH") + "\n",  # a longer word
    "short: "
    + token("hf_", "abc")
    + " "
    + token("sk-", "proj-1")
    + " "
    + token("ghp_", "x1")
    + "\n",
    "AKIAEXAMPLE and X" + token("AKIA", "IOSFODNN7EXAMPLE") + " and " + token("AKIA", "ABC") + "\n",
    token("AKIA", "IOSFODNN7EXAMPLE") + "MORE\n",  # longer than an id
    "xoxb-not-a-token-at-all\n",
    "-----BEGIN CERTIFICATE-----\nMIIB\n-----BEGIN PUBLIC KEY-----\n",
    "digest: sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08\n",
]


@pytest.mark.parametrize("text", LOOK_ALIKES)
@pytest.mark.parametrize("name", ["notes.txt", "model.py"])
def test_ordinary_text_and_code_that_looks_like_a_token_is_kept(tmp_path, text, name):
    from qgtrain.launch.secretfiles import why_left_out

    (tmp_path / name).write_text(text)
    assert why_left_out(name, tmp_path / name, ()) is None


def test_qgtrain_and_its_tests_hold_no_token_so_a_snapshot_of_them_keeps_every_file():
    from qgtrain.launch.secretfiles import secret_in

    found = {str(p): secret_in(p) for p in sorted(ROOT.glob("[qt]*/**/*.py"))}
    assert len(found) > 100 and not {p: kind for p, kind in found.items() if kind}


@pytest.mark.parametrize("before", [0, 1, 5, 33, 200])
@pytest.mark.parametrize("kind, value", [EVERY_TOKEN[0], EVERY_TOKEN[-1]], ids=["hf", "key"])
def test_a_token_cut_by_the_read_size_is_found_and_its_word_boundary_kept(
    tmp_path, kind, value, before
):
    """The file is read a piece at a time: a token that starts `before` bytes ahead of the end of
    the first piece is found whole in the second; one continuing a word across the cut is not."""
    from qgtrain.launch import secretfiles

    size = secretfiles._CHUNK
    path = tmp_path / "big.txt"
    path.write_bytes(b"x" * (size - before - 1) + b" " + value.encode() + b" end\n")
    assert secretfiles.secret_in(path) == kind
    path.write_bytes(b"x" * (size - before) + value.encode() + b" end\n")
    assert secretfiles.secret_in(path) == (kind if kind == "a private key" else None)
    path.write_bytes(b"x" * 3 * size + b"\n" + b"y" * (size // 2))
    assert secretfiles.secret_in(path) is None


def git_project(root: Path) -> Path:
    folder = root / "project"
    folder.mkdir()
    (folder / "config.yaml").write_text("train: {run_name: demo}\nlogging: {runs_dir: runs}\n")
    (folder / "my_task.py").write_text("VALUE = 1\n")
    (folder / ".gitignore").write_text("runs/\n")
    subprocess.run(["git", "init", "-q"], cwd=folder, check=True)
    return folder


def commit(folder: Path) -> None:
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "add", "-A"], cwd=folder, check=True)
    subprocess.run([*git, "commit", "-qm", "state"], cwd=folder, check=True)


def test_submit_names_each_file_left_out_for_its_text_and_never_the_token(tmp_path):
    folder = git_project(tmp_path)
    hf, aws = TOKENS["a Hugging Face token"][0], TOKENS["an AWS access key id"][0]
    github = TOKENS["a GitHub token"][0]
    (folder / "env.sh").write_text(f"export HF_TOKEN={hf}\n")
    (folder / "notes.txt").write_text(f"aws {aws}\n")
    (folder / "config.py").write_text(f"KEY = {github!r}\n")
    for name in ("kaggle.json", "hf_token.txt", "api_keys.json", "tokenizer.json"):
        (folder / name).write_text("{}\n")
    done = cli("submit", "--config", "config.yaml", cwd=folder, env=stand_in_sbatch(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if "leaves out" in line]
    assert len(said) == 1, done.stderr
    for named in (
        "env.sh (holds what looks like a Hugging Face token)",
        "notes.txt (holds what looks like an AWS access key id)",
        "config.py (holds what looks like a GitHub token)",
        "api_keys.json, hf_token.txt, kaggle.json (named like a credential)",
    ):
        assert named in said[0], said[0]
    run = folder / "runs" / "demo"
    written = {"console": (done.stdout + done.stderr).encode(), **every_file(run)}
    for where, text in written.items():
        assert not any(value.encode() in text for value in (hf, aws, github)), where
    (code,) = [p for p in (run / "code").iterdir() if p.name != "jobs"]
    copied = {p.name for p in (code / "submit").iterdir()}
    assert {"my_task.py", "config.yaml", "tokenizer.json"} <= copied
    assert not copied & {"env.sh", "notes.txt", "config.py", "kaggle.json", "hf_token.txt"}


def test_the_recorded_diff_keeps_out_the_files_left_out_and_any_token_in_removed_lines(tmp_path):
    """snapshot.json keeps `git diff HEAD`: a token added to a tracked file left out is not in it,
    and a token only in the lines a change removed drops the diff, saying why."""
    from qgtrain.launch import codesnap

    folder = git_project(tmp_path)
    (folder / "env.sh").write_text("export HF_HOME=/scratch\n")
    commit(folder)
    hf = TOKENS["a Hugging Face token"][0]
    (folder / "env.sh").write_text(f"export HF_TOKEN={hf}\n")
    (folder / "my_task.py").write_text("VALUE = 2\n")
    code = codesnap.take(folder, tmp_path / "run" / "code", 50)
    record = codesnap.read_record(code.folder)
    assert "-VALUE = 1\n+VALUE = 2" in str(record["diff"]) and hf not in str(record["diff"])
    assert record["left_out"] == ["env.sh"]
    commit(folder)  # the token is in HEAD now, and taken out of the file again
    (folder / "env.sh").write_text("export HF_HOME=/scratch\n")
    code = codesnap.take(folder, tmp_path / "run" / "code", 50)
    record = codesnap.read_record(code.folder)
    assert record["diff"] == "" and record["left_out"] == []
    assert record["diff_left_out"] == "it holds what looks like a Hugging Face token"
    assert not any(hf.encode() in text for text in every_file(code.folder).values())


PLANTED = ("\x1b]0;pwned\x07", "\x1b[2J")


def test_eval_shows_a_planted_results_line_escaped(tmp_path):
    """A results line (or a task file) is anyone's text who could write its folder: its task name,
    metric names and figures and step label are shown escaped, as is the error line a task file's
    content makes. The run is trained one step; eval finds its checkpoint already scored and
    prints the table from the file alone."""
    from qgtrain.config.load import load_config
    from qgtrain.ops.eval_results import scored_as

    run = tmp_path / "run"
    trained = cli(
        *train_command(run, *TINY, "train.max_steps=1", "checkpoint.every_steps=1"),
        cwd=tmp_path,
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    (tmp_path / "text.jsonl").write_text('{"text": "one line of text"}\n')
    tasks = f"eval.tasks=[{{name: facts, kind: perplexity, files: ['{tmp_path / 'text.jsonl'}']}}]"
    digest = scored_as(load_config([run / "config.yaml"], [tasks]))["facts"]
    title, clear = PLANTED
    lines = [  # the first stands for step 1's task as now asked, so eval scores nothing
        {"step": 1, "task": "facts", f"eval_{title}loss": clear, "eval_ppl": 1.5},
        {"step": f"1{clear}", "task": f"facts{title}", "eval_facts_loss": 2.0},
    ]
    lines[0]["scored_as"] = digest
    (run / "eval").mkdir(mode=0o700)
    (run / "eval" / "results.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = cli("eval", str(run), "--set", tasks, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "\x1b" not in done.stdout + done.stderr and "\x07" not in done.stdout + done.stderr
    assert "eval_\\x1b]0;pwned\\x07loss \\x1b[2J eval_ppl 1.5000" in done.stdout
    assert "1\\x1b[2J" in done.stdout and "facts\\x1b]0;pwned\\x07" in done.stdout
    choice = {"context": "c", "choices": f"{title}{clear}", "label": 0}  # not a list: refused
    (tmp_path / "text.jsonl").write_text(json.dumps(choice) + "\n")
    asked = tasks.replace("perplexity", "multiple_choice")
    said = one_error_line(cli("eval", str(run), "--set", asked, cwd=tmp_path))
    assert "'choices' must be a list" in said and "got \\x1b]0;pwned\\x07\\x1b[2J" in said


def test_data_info_shows_a_planted_cache_description_escaped(tmp_path):
    """A shared data.cache_dir's meta.json is anyone's text who could write the cache."""
    title, clear = PLANTED
    entry = tmp_path / "cache" / "entry"
    entry.mkdir(parents=True)
    meta = {"tokens": {"train": 10}, "tokenizer": f"gpt2{title}", "corpus": clear, "sources": {}}
    (entry / "meta.json").write_text(json.dumps(meta))
    done = cli("data", "info", str(tmp_path / "cache"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "\x1b" not in done.stdout + done.stderr, done.stdout
    assert "tokenizer gpt2\\x1b]0;pwned\\x07," in done.stdout and "\\x1b[2J" in done.stdout
