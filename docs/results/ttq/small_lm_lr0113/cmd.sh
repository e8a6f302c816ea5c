#!/bin/bash
# the small LM's time to target at lr 1.13e-2 (dense's best of 4e-3 / 8e-3 / 1.13e-2 over 2000 steps): the quality
# phase, then the timing phase (root: two namespaces joined by a tc-throttled veth); pass 1 with the default
# --time-steps 60, pass 2 (this script) with 150
cd "$(dirname "$0")/../../../.." && . launch/setup_env.sh >/dev/null 2>&1
COMMON=(--out runs/ttq_lr --steps 2000 --eval-every 50 --n-layer 2 --d-model 64 --n-head 2 --ctx 32 --eval-windows 64 --lr 0.0113
  --mode 'diloco_sgd_h30={"dragonn": {"enabled": true, "sync": "local_steps", "local_steps": 30, "density": 1.0, "outer_lr": 1.0}}'
  --mode 'diloco_auto_h30={"dragonn": {"enabled": true, "sync": "local_steps", "local_steps": 30, "density": 1.0}}'
  --mode 'local_h30_d0.1_int4={"dragonn": {"enabled": true, "sync": "local_steps", "local_steps": 30, "density": 0.1, "advanced": {"values": "int4"}}}'
  --mode 'local_h30_d0.1_int4_olr2={"dragonn": {"enabled": true, "sync": "local_steps", "local_steps": 30, "density": 0.1, "outer_lr": 2.0, "advanced": {"values": "int4"}}}')
python launch/bench_ttq.py quality "${COMMON[@]}" --modes ds_fp32,ds_bf16,dragonn
bash launch/bench_ttq.sh --skip-quality --time-steps 150 --links "10mbit 100mbit" "${COMMON[@]}" --modes "ds_fp32 ds_bf16 dragonn none"
for f in 0.8 0.5; do python launch/bench_ttq.py report --out runs/ttq_lr --target-fraction $f; done
