#!/usr/bin/env bash
# Set up qgtrain in ./.venv: torch, qgtrain and its dependencies, and the directories config.yaml names.
# Safe to run again. torch: where a GPU is visible, PyPI's CUDA build; otherwise `pip install torch`
# as pip is configured here (a local wheel folder may hold the CPU build; from PyPI itself it is the CUDA
# build, which also runs on a CPU: set QGTRAIN_TORCH below for the smaller CPU-only wheel).
#
#   ./setup.sh          everything needed to train
#   ./setup.sh --dev    also the test tools (pytest)
#
# Environment:
#   QGTRAIN_TORCH="<pip arguments>"  install torch your site's way, e.g.
#                                    QGTRAIN_TORCH="torch==2.10.0 --index-url https://download.pytorch.org/whl/cu126"
#                                    QGTRAIN_TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
#   QGTRAIN_TORCH=system             use the torch already on the system (e.g. from `module load`):
#                                    the venv sees system packages and setup.sh installs no torch;
#                                    one older than 2.10 is refused (its weights_only loader, which
#                                    keeps checkpoints data, has CVE-2026-24747) unless
#   QGTRAIN_ALLOW_OLD_TORCH=1        says you accept that: qgtrain is installed beside it
#   QGTRAIN_VENV=DIR                 where the virtual environment goes (default .venv)
#   PYTHON=python3.11                the interpreter that creates it
set -euo pipefail
cd "$(dirname "$0")"

TORCH_VERSION=2.13.0
TORCH_FLOOR="(2, 10)"  # pyproject.toml's torch floor
VENV=${QGTRAIN_VENV:-.venv}
PYTHON=${PYTHON:-python3}
EXTRAS=""
case "${1:-}" in
    --dev) EXTRAS="[dev]" ;;
    "") ;;
    *) echo "usage: ./setup.sh [--dev]" >&2; exit 2 ;;
esac

"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
    || { echo "setup.sh: $PYTHON is older than 3.10; set PYTHON=python3.11 (or newer)" >&2; exit 2; }

if [ ! -x "$VENV/bin/python" ]; then
    if [ "${QGTRAIN_TORCH:-}" = system ]; then
        "$PYTHON" -m venv --system-site-packages "$VENV"
    else
        "$PYTHON" -m venv "$VENV"
    fi
fi
py="$VENV/bin/python"
pip=("$py" -m pip --disable-pip-version-check -q)

have_torch() { "$py" -c "import torch, sys; sys.exit(not torch.__version__.startswith('$TORCH_VERSION'))" 2>/dev/null; }
old_torch=""
if [ "${QGTRAIN_TORCH:-}" = system ]; then
    "$py" -c 'import torch' 2>/dev/null \
        || { echo "setup.sh: QGTRAIN_TORCH=system but no torch is importable; load your site's module first" >&2; exit 2; }
    if ! "$py" -c "import torch, sys; sys.exit(tuple(map(int, torch.__version__.split('+')[0].split('.')[:2])) < $TORCH_FLOOR)"; then
        found=$("$py" -c 'import torch; print(torch.__version__)')
        if [ "${QGTRAIN_ALLOW_OLD_TORCH:-}" != 1 ]; then
            echo "setup.sh: the system's torch $found is older than 2.10: its weights_only loader, which keeps a checkpoint data and never code, can corrupt memory on a crafted file (CVE-2026-24747). HINT: load a torch >= 2.10 module, or set QGTRAIN_ALLOW_OLD_TORCH=1 to use $found anyway" >&2
            exit 2
        fi
        echo "setup.sh: using torch $found, older than 2.10 (CVE-2026-24747), as QGTRAIN_ALLOW_OLD_TORCH=1 says" >&2
        old_torch=$found
    fi
elif [ -n "${QGTRAIN_TORCH:-}" ]; then
    # shellcheck disable=SC2086  # the variable holds pip arguments, split on purpose
    "${pip[@]}" install $QGTRAIN_TORCH
elif have_torch; then
    :
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    # PyPI's Linux wheel is the CUDA build; --isolated skips local wheel folders that may hold a CPU build
    "${pip[@]}" --isolated install "torch==$TORCH_VERSION"
else
    "${pip[@]}" install "torch==$TORCH_VERSION"
fi

if [ -n "$old_torch" ]; then
    # pip would replace the system's torch to meet the floor: install qgtrain without it, then the
    # rest of what it requires (the dev extra's too with --dev)
    "${pip[@]}" install --no-deps -e ".$EXTRAS"
    mapfile -t rest < <("$py" - "$EXTRAS" <<'PY'
import importlib.metadata, re, sys
for req in importlib.metadata.requires("qgtrain") or []:
    name, _, marker = (part.strip() for part in req.partition(";"))
    extra = re.search(r"extra\s*==\s*[\"'](\w+)[\"']", marker)
    wanted = extra is None or f"[{extra.group(1)}]" == sys.argv[1]
    if wanted and not re.match(r"torch(?![\w-])", name):
        print(name)
PY
)
    "${pip[@]}" install "${rest[@]}"
else
    "${pip[@]}" install -e ".$EXTRAS"
fi

for key in logging.runs_dir data.cache_dir slurm.output_dir; do
    mkdir -p "$("$py" -m qgtrain config --get "$key")"
done

"$py" - <<'PY'
import torch
gpus = torch.cuda.device_count()
print(f"qgtrain is set up: torch {torch.__version__}, " + (f"{gpus} GPU(s)" if gpus else "CPU only"))
PY
echo "next: .venv/bin/qgtrain train      (or: sbatch train.slurm on a Slurm cluster)"
