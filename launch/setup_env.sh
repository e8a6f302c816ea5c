#!/usr/bin/env bash
# Idempotent set-up, sourced by launch/main.sh and launch/test.sh (and by you: `. launch/setup_env.sh`):
# a virtual environment at .venv (or the one already active), torch, then this package with its MPI
# and test extras, then the environment variables local runs need. Re-runs are instant: a stamp records
# the hash of setup.py and of this script. Sourcing it leaves your shell's options as they were.
#   DS_DRAGONN_TORCH_INDEX  optional pip index URL for torch (e.g. a CPU-only wheel index)
_ds_dragonn_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

_ds_dragonn_install() (
  set -euo pipefail
  repo="$1" log="$VIRTUAL_ENV/ds_dragonn_setup.log"
  echo "[setup] installing into $VIRTUAL_ENV (log: $log)" >&2
  : > "$log"
  pip_q() { python -m pip install -q "$@" >>"$log" 2>&1 || { tail -40 "$log" >&2; return 1; }; }
  pip_q --upgrade pip
  if ! python -c "import torch" 2>/dev/null; then
    if [[ -n "${DS_DRAGONN_TORCH_INDEX:-}" ]]; then
      pip_q "torch==2.13.0" --index-url "$DS_DRAGONN_TORCH_INDEX"
    elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
      pip_q torch            # a GPU machine: the default (CUDA) build
    else
      pip_q "torch==2.13.0"  # CPU machine: pinned first so that deepspeed never pulls another torch
    fi
  fi
  pip_q -e "$repo[mpi,test]"
  # build the C++ selection kernel now (cached), not in the first training step
  python -c "from ds_dragonn.compress.kernels import cpu_table; cpu_table.available()" >>"$log" 2>&1 || true
  # and DeepSpeed's CPU shared-memory allreduce (JIT, ~1 min): otherwise the first multi-rank run builds it in
  # every rank at once, and on a fresh machine the first test fixture can time out waiting for that build
  if [[ "${DS_ACCELERATOR:-}" == cpu ]]; then
    python -c "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder; ShareMemCommBuilder().load()" \
      >>"$log" 2>&1 || true
  fi
  echo "[setup] done: torch $(python -c 'import torch; print(torch.__version__)'), $(python -c 'import deepspeed; print("deepspeed", deepspeed.__version__)' 2>/dev/null)" >&2
)

if [[ -z "${VIRTUAL_ENV:-}" ]]; then
  if [[ ! -x "$_ds_dragonn_repo/.venv/bin/python" ]]; then
    python3 -m venv "$_ds_dragonn_repo/.venv" || { echo "[setup] python3 -m venv failed" >&2; return 1 2>/dev/null || exit 1; }
  fi
  # shellcheck disable=SC1091
  . "$_ds_dragonn_repo/.venv/bin/activate"
fi
export PYTHONPATH="$_ds_dragonn_repo${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$_ds_dragonn_repo/.cache/torch_extensions}"  # JIT builds cached
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # 2 ranks x 2 threads oversubscribe 2 cores
export MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"  # local runs stay on loopback
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  export DS_ACCELERATOR="${DS_ACCELERATOR:-cuda}"
else
  export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
fi
_ds_dragonn_want="$(cat "$_ds_dragonn_repo/setup.py" "$_ds_dragonn_repo/launch/setup_env.sh" | sha256sum | cut -c1-16)"
if [[ "$(cat "$VIRTUAL_ENV/.ds_dragonn_setup" 2>/dev/null)" != "$_ds_dragonn_want" ]]; then
  if _ds_dragonn_install "$_ds_dragonn_repo"; then
    echo "$_ds_dragonn_want" > "$VIRTUAL_ENV/.ds_dragonn_setup"
  else
    echo "[setup] failed; see $VIRTUAL_ENV/ds_dragonn_setup.log" >&2
    return 1 2>/dev/null || exit 1
  fi
fi
unset _ds_dragonn_want
