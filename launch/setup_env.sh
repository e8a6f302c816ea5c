#!/usr/bin/env bash
# Idempotent set-up, sourced by launch/main.sh and launch/test.sh: a virtual environment at .venv
# (or the one already active), torch, then this package with its MPI and test extras.
# Re-runs are instant: a stamp records the hash of setup.py and of this script.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${VIRTUAL_ENV:-}" ]]; then
  [[ -x "$REPO/.venv/bin/python" ]] || python3 -m venv "$REPO/.venv"
  # shellcheck disable=SC1091
  . "$REPO/.venv/bin/activate"
fi
STAMP="$VIRTUAL_ENV/.ds_dragonn_setup"
WANT="$(cat "$REPO/setup.py" "$REPO/launch/setup_env.sh" | sha256sum | cut -c1-16)"
if [[ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]]; then
  echo "[setup] installing into $VIRTUAL_ENV" >&2
  python -m pip install -q --upgrade pip
  if ! python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
      python -m pip install -q torch            # a GPU machine: the default (CUDA) build
    else
      python -m pip install -q "torch==2.13.0"  # CPU machine: the CPU build, never a multi-GB CUDA one
    fi
  fi
  python -m pip install -q -e "$REPO[mpi,test]"
  # build the C++ selection kernel now (cached), not in the first training step
  TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$REPO/.cache/torch_extensions}" \
    python -c "from ds_dragonn.compress.kernels import cpu_table; cpu_table.available()" || true
  echo "$WANT" > "$STAMP"
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export DS_ACCELERATOR="${DS_ACCELERATOR:-$(python -c 'import torch;print("cuda" if torch.cuda.is_available() else "cpu")')}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$REPO/.cache/torch_extensions}"  # JIT builds cached
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # 2 ranks x 2 threads oversubscribe 2 cores
export MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"  # local runs stay on loopback
