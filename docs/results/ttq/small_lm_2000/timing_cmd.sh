#!/bin/bash
# the timing phase and report of the small-LM time-to-target run (after ttq_small_cmd.sh's quality phase)
cd .
exec bash launch/bench_ttq.sh --skip-quality --out runs/ttq_small --links "10mbit 100mbit" --steps 2000 --eval-every 50 \
  --n-layer 2 --d-model 64 --n-head 2 --ctx 32 --eval-windows 64 \
  --modes "ds_fp32 dragonn local_h30_d0.01 diloco_h30 ds_bf16 none" \
  --mode 'd0001_int4_dw1000_age300={"dragonn": {"enabled": true, "density": 0.001, "density_warmup_steps": 1000, "advanced": {"values": "int4", "dense_values": "int4", "max_age": 300}}}' \
  --mode 'd001_int4={"dragonn": {"enabled": true, "density": 0.01, "advanced": {"values": "int4", "dense_values": "int4"}}}'
