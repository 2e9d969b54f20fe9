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
#                                    QGTRAIN_TORCH="torch==2.5.1 --index-url https://download.pytorch.org/whl/cu121"
#                                    QGTRAIN_TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
#   QGTRAIN_TORCH=system             use the torch already on the system (e.g. from `module load`):
#                                    the venv sees system packages and setup.sh installs no torch
#   QGTRAIN_VENV=DIR                 where the virtual environment goes (default .venv)
#   PYTHON=python3.11                the interpreter that creates it
set -euo pipefail
cd "$(dirname "$0")"

TORCH_VERSION=2.13.0
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
if [ "${QGTRAIN_TORCH:-}" = system ]; then
    "$py" -c 'import torch' 2>/dev/null \
        || { echo "setup.sh: QGTRAIN_TORCH=system but no torch is importable; load your site's module first" >&2; exit 2; }
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

"${pip[@]}" install -e ".$EXTRAS"

for key in logging.runs_dir data.cache_dir slurm.output_dir; do
    mkdir -p "$("$py" -m qgtrain config --get "$key")"
done

"$py" - <<'PY'
import torch
gpus = torch.cuda.device_count()
print(f"qgtrain is set up: torch {torch.__version__}, " + (f"{gpus} GPU(s)" if gpus else "CPU only"))
PY
echo "next: .venv/bin/qgtrain train      (or: sbatch train.slurm on a Slurm cluster)"
