#!/usr/bin/env bash
# One prepared GPU check: on a machine with a CUDA GPU, run the kernel tests on the GPU (Triton kernels
# against the PyTorch reference, element by element) and the compression benchmark, and write everything
# to one folder.
#
#   bash launch/gpu_check.sh [OUTDIR]        # OUTDIR defaults to $OUT, else docs/gpu/$(date +%F)
#
# GPU_CHECK_SCOPE=user (default; ~8 min on one H200) runs what a user pays: the kernel tests, selection
# against one read pass, torch.topk and DGC at 2^20..2^28 fp32 (selection_gpu.*), the whole compressed step
# per bucket against the read pass, the device syncs per reduction (torch.profiler and the sync debug mode)
# and the peak memory dense against DRAGONN at ZeRO 0-3 (tests/gpu/user_cost.py: step_cost.json,
# syncs.json, memory.json; its --dry-run runs on CPU), and sync_count.json. GPU_CHECK_SCOPE=full adds the
# steps below (test_compress, test_wire, the training runs, fp16, the LM, bench_step).
#
# Writes: env.txt (nvidia-smi, versions), test_kernels.log, test_wire.log, bench.log and selection_gpu.{json,png,md} (the
# compression benchmark), train_cuda.{log,json} (the main job's DRAGONN run on CUDA, world size 1 over
# NCCL), fp16_engine.log (skipped steps and the loss scale), train_lm_cuda.{log,json} (the LM with the
# default warm-ups), train_lm_local_steps_cuda.{log,json} (local steps), phases_gpu.{log,json} (launch/bench_step.py: per-phase step cost on the GPU),
# status.txt (one line per step: ok / FAILED rc).
# Budget: set-up 1-3 min on a fresh machine (torch wheel), tests < 1 min, benchmark ~3-5 min on an H200
# (--budget-s bounds each method). Set GPU_CHECK_QUICK=1 for the 2^20/2^22/2^24 fp32 benchmark only,
# GPU_CHECK_STEP_S to bound each step (default 900 s; rc 124 in status.txt = timed out).
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUTDIR="${1:-${OUT:-$REPO/docs/gpu/$(date +%F)}}"
SCOPE="${GPU_CHECK_SCOPE:-user}"
[[ "$SCOPE" == user ]] && : "${GPU_CHECK_STEP_S:=240}"  # each step bounded so the whole fits in ~8 min
mkdir -p "$OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"
STATUS="$OUTDIR/status.txt"
: > "$STATUS"
step() {  # step NAME LOGFILE CMD...: run, record ok/FAILED, never abort the remaining steps
  local name="$1" log="$2"; shift 2
  echo "== $name" >&2
  local cmd=("$@")
  [[ "${cmd[0]}" == python ]] && cmd[0]="$PY"  # timeout runs programs, not the shell function python
  # bounded: an NCCL hang in one step must not eat the remaining ones (GPU_CHECK_STEP_S seconds each)
  timeout -k 10 "${GPU_CHECK_STEP_S:-900}" "${cmd[@]}" > "$log" 2>&1
  local rc=$?
  if [[ $rc -eq 0 ]]; then echo "$name ok" >> "$STATUS"; else echo "$name FAILED rc=$rc (see $log)" >> "$STATUS"; fi
  tail -n 25 "$log" >&2
  return $rc
}

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "no CUDA GPU here (nvidia-smi missing or failing): nothing to check" | tee -a "$STATUS" >&2
  exit 2
fi
nvidia-smi > "$OUTDIR/env.txt" 2>&1

cd "$REPO"
# Python: an interpreter that already has CUDA torch (a GPU machine may have no network, so prefer what
# is installed: $PYTHON, the active venv, .venv, python3), else the project's set-up (needs PyPI).
has_cuda_torch() { "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; }
PY=""
for cand in "${PYTHON:-}" "${VIRTUAL_ENV:+$VIRTUAL_ENV/bin/python}" "$REPO/.venv/bin/python" python3 python; do
  if [[ -n "$cand" ]] && command -v "$cand" >/dev/null 2>&1 && has_cuda_torch "$cand"; then PY="$cand"; break; fi
done
if [[ -z "$PY" ]]; then
  # shellcheck disable=SC1091
  . "$REPO/launch/setup_env.sh" >> "$OUTDIR/env.txt" 2>&1 || echo "setup_env.sh FAILED" >> "$STATUS"
  PY="$(command -v python)"
fi
echo "python: $PY" >> "$OUTDIR/env.txt"
python() { "$PY" "$@"; }
# this package's imports and the test tools; install what is missing (best effort: may be offline)
for mod in deepspeed pydantic pytest mmh3 matplotlib triton; do
  if ! python -c "import $mod" >/dev/null 2>&1; then
    python -m pip install -q "$mod" >> "$OUTDIR/env.txt" 2>&1 || echo "pip install $mod FAILED" >> "$STATUS"
  fi
done
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$REPO/.cache/torch_extensions}"
export DS_ACCELERATOR=cuda
unset TRITON_INTERPRET  # compile the Triton kernels for the GPU, do not interpret them
export OMP_NUM_THREADS="$(nproc)"

python - <<'PY' >> "$OUTDIR/env.txt" 2>&1
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name())
PY
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "torch in $PY has no CUDA (a CPU build?): install the CUDA build, e.g." \
       "pip install --force-reinstall torch" | tee -a "$STATUS" >&2
  exit 3
fi
python -c "import triton; print('triton', triton.__version__)" >> "$OUTDIR/env.txt" 2>&1

rc=0
step test_kernels "$OUTDIR/test_kernels.log" \
  python -m pytest tests/test_kernels.py -q -p no:cacheprovider -rs || rc=1
# what a user pays per bucket: the whole step against one read pass, syncs, peak memory at ZeRO 0-3
step user_cost "$OUTDIR/user_cost.log" \
  python tests/gpu/user_cost.py --outdir "$OUTDIR" --sizes 20 22 24 26 || rc=1
step sync_count "$OUTDIR/sync_count.log" \
  python tests/gpu/sync_count.py --numel $((1 << 24)) --out "$OUTDIR/sync_count.json" || rc=1
if [[ "$SCOPE" == user ]]; then
  # selection against one read pass, torch.topk and DGC, fp32 at density 0.01, 2^20..2^28
  step bench_gpu "$OUTDIR/bench.log" python launch/bench_compress.py --device cuda --dtypes fp32 \
    --densities 0.01 --sizes 20 22 24 26 28 --budget-s 2 --repeat 5 --max-reference-exp 20 \
    --json "$OUTDIR/selection_gpu.json" --plot "$OUTDIR/selection_gpu.png" --markdown "$OUTDIR/selection_gpu.md" || rc=1
  echo "outputs in $OUTDIR:" >&2
  cat "$STATUS" >&2
  exit $rc
fi
# the full scope's records report per-phase ms (train.py's summaries): time every reduction's phases
export DS_DRAGONN_PHASE_TIMING=1
# also the project's compressor tests on this machine (CPU tensors, reference + cpu kernel)
step test_compress "$OUTDIR/test_compress.log" \
  python -m pytest tests/test_compress.py -q -p no:cacheprovider || rc=1
# the packed positions of the wire (sort, searchsorted, repeat_interleave) on CUDA tensors
step test_wire "$OUTDIR/test_wire.log" \
  python -m pytest tests/test_wire.py -q -p no:cacheprovider -rs || rc=1

BENCH=(python launch/bench_compress.py --device cuda --json "$OUTDIR/selection_gpu.json"
       --plot "$OUTDIR/selection_gpu.png" --markdown "$OUTDIR/selection_gpu.md" --budget-s 5
       --max-reference-exp 28)
if [[ "${GPU_CHECK_QUICK:-0}" == "1" ]]; then BENCH+=(--quick); fi
step bench_gpu "$OUTDIR/bench.log" "${BENCH[@]}" || rc=1
# the engine's compressed path on CUDA tensors: world size 1 over NCCL still runs compress -> exchange ->
# decode (configs/dragonn.json has "policy": "always"), then the per-phase step benchmark on the GPU
step train_cuda "$OUTDIR/train_cuda.log" \
  python -m deepspeed.launcher.runner --num_gpus 1 --master_addr 127.0.0.1 --master_port 29533 \
  launch/train.py --deepspeed_config configs/dragonn.json --steps 100 --summary "$OUTDIR/train_cuda.json" || rc=1
# the partitioned exchange and the ZeRO-2 hook (sparse reduce-scatter) on CUDA tensors, world size 1 over NCCL
step train_cuda_partitioned "$OUTDIR/train_cuda_partitioned.log" \
  python -m deepspeed.launcher.runner --num_gpus 1 --master_addr 127.0.0.1 --master_port 29534 \
  launch/train.py --deepspeed_config configs/dragonn_partitioned.json --steps 100 \
  --summary "$OUTDIR/train_cuda_partitioned.json" || rc=1
step train_cuda_zero2 "$OUTDIR/train_cuda_zero2.log" \
  python -m deepspeed.launcher.runner --num_gpus 1 --master_addr 127.0.0.1 --master_port 29535 \
  launch/train.py --deepspeed_config configs/dragonn_zero2.json --steps 100 --summary "$OUTDIR/train_cuda_zero2.json" || rc=1
# the ZeRO-3 hook (DeepSpeedZeroOptimizer_Stage3.__avg_scatter_grads: rank-major layout, sparse reduce-scatter)
# on CUDA tensors, world size 1 over NCCL
step train_cuda_zero3 "$OUTDIR/train_cuda_zero3.log" \
  python -m deepspeed.launcher.runner --num_gpus 1 --master_addr 127.0.0.1 --master_port 29539 \
  launch/train.py --deepspeed_config configs/dragonn_zero3.json --steps 100 --summary "$OUTDIR/train_cuda_zero3.json" || rc=1
# fp16 with dynamic loss scaling (DeepSpeed refuses fp16 on CPU): an overflow step leaves every residual as
# it was, the residuals follow the loss scale as it halves and doubles
step fp16_engine "$OUTDIR/fp16_engine.log" \
  python -m deepspeed.launcher.runner --num_gpus 1 --master_addr 127.0.0.1 --master_port 29536 \
  tests/gpu/fp16_engine.py --precision fp16 || rc=1
# the LM with the product's defaults ("auto": 100 dense warm-up steps after its 50-step learning-rate warm-up,
# then the density warm-up, Adam's variance frozen, and at step 199 one variance refresh: a dense raw-gradient
# step through NCCL, no update)
step train_lm_cuda "$OUTDIR/train_lm_cuda.log" \
  python -m deepspeed.launcher.runner --num_gpus 1 --master_addr 127.0.0.1 --master_port 29537 \
  launch/train_lm.py --deepspeed_config configs/lm_dragonn.json --steps 210 --log-interval 30 \
  --summary "$OUTDIR/train_lm_cuda.json" || rc=1
# local steps (sync: local_steps) on CUDA: fp32 masters on the GPU, an outer step every 30 steps whose
# pseudo-gradient goes through the Triton selection and the NCCL exchange (world size 1)
step train_lm_local_steps_cuda "$OUTDIR/train_lm_local_steps_cuda.log" \
  python -m deepspeed.launcher.runner --num_gpus 1 --master_addr 127.0.0.1 --master_port 29538 \
  launch/train_lm.py --deepspeed_config configs/lm_local_steps.json --steps 90 --log-interval 30 \
  --summary "$OUTDIR/train_lm_local_steps_cuda.json" || rc=1
# per-phase step cost on the GPU; its +pt rows run per-tensor selection (Triton, one launch set per tensor)
step bench_step_cuda "$OUTDIR/phases_gpu.log" \
  python launch/bench_step.py --device cuda --steps 20 --json "$OUTDIR/phases_gpu.json" || rc=1
echo "outputs in $OUTDIR:" >&2
cat "$STATUS" >&2
exit $rc
