"""Smoke tests of the step and link benchmarks' plumbing (never of their timings)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(args, timeout=300):
    proc = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_bench_step_writes_every_phase(tmp_path):
    out = tmp_path / "step.json"
    text = _run(["launch/bench_step.py", "--layers", "300,200,10", "--steps", "2", "--dtypes", "fp32,bf16+txn",
                 "--json", str(out)])
    assert "whole step (no wire)" in text and "one read pass (floor)" in text
    recs = json.loads(out.read_text())["records"]
    assert [(r["dtype"], r["transactional"]) for r in recs] == [("float32", False), ("bfloat16+txn", True)]
    for r in recs:
        assert r["numel"] == 300 * 200 + 200 + 200 * 10 + 10
        for key in ("compensate_ms", "select_ms", "exchange_ms", "residual_ms", "decode_ms", "total_ms",
                    "floor_ms", "x_floor", "dense_local_ms"):
            assert r[key] >= 0, key
        assert 0 < r["kept"] <= 4 * r["k"]


def test_bench_link_report_table_json_plot(tmp_path):
    """The report step of the link benchmark (the runs themselves need root and network namespaces)."""
    recs = []
    for mode, link, ms in [("none", "1gbit", 100.0), ("ds_dense_fp32", "1gbit", 400.0), ("dragonn", "1gbit", 110.0),
                           ("none", "unthrottled", 90.0), ("ds_dense_fp32", "unthrottled", 120.0)]:
        rec = {"mode": mode, "link": link, "link_gbit": 1.0 if link == "1gbit" else None, "world_size": 2,
               "ms_per_step": ms, "steps_per_s": 1e3 / ms, "tx_bytes_per_step": 1e6, "bytes_sent_per_step": 1e6,
               "heldout_accuracy": 0.9, "steps": 10, "time_to_accuracy_s": None, "target_accuracy": 0.88}
        path = tmp_path / f"{mode}@{link}.json"
        path.write_text(json.dumps(rec))
        recs.append(str(path))
    out, png = tmp_path / "link.json", tmp_path / "link.png"
    text = _run(["launch/bench_link.py", "--report", *recs, "--json", str(out), "--plot", str(png)])
    assert "dragonn" in text and png.stat().st_size > 0
    rows = {(r["mode"], r["link"]): r for r in json.loads(out.read_text())}
    assert abs(rows[("dragonn", "1gbit")]["x_no_exchange"] - 1.1) < 1e-9
    assert abs(rows[("dragonn", "1gbit")]["speedup_vs_ds_dense_fp32"] - 400 / 110) < 1e-9
    for key in ("mode", "link_gbit", "world_size", "ms_per_step", "steps_per_s", "tx_bytes_per_step",
                "bytes_sent_per_step", "heldout_accuracy", "steps", "time_to_accuracy_s"):
        assert key in rows[("dragonn", "1gbit")]


def test_bench_scaling_records_both_schemes(tmp_path):
    out, png = tmp_path / "scaling.json", tmp_path / "scaling.png"
    text = _run(["launch/bench_scaling.py", "--world-sizes", "2,3", "--layers", "784,64,10", "--steps", "1",
                 "--json", str(out), "--plot", str(png)])
    assert "partitioned" in text and "allgather" in text and png.stat().st_size > 0
    recs = json.loads(out.read_text())["records"]
    keys = {"exchange", "world_size", "density", "bytes_sent_per_rank", "bytes_received_per_rank", "imbalance",
            "exchange_ms"}
    assert all(keys <= set(r) for r in recs)
    got = {(r["exchange"], r["gradient"], r["world_size"], r["density"]) for r in recs}
    assert got == {(x, g, p, d) for x, g in (("allgather", "real"), ("partitioned", "real"), ("partitioned", "skewed"))
                   for p in (2, 3) for d in (0.01, 0.001)}
    for r in recs:
        assert r["bytes_sent_per_rank"] > 0 and r["bytes_received_per_rank"] > 0
        if r["exchange"] == "partitioned":
            assert r["imbalance"] >= 1.0


def test_variance_drift_ratios_start_at_one(tmp_path):
    """launch/variance_drift.py: the ratio is 1 at the freeze step for every tensor, then moves; JSON and PNG."""
    out, png = tmp_path / "v.json", tmp_path / "v.png"
    text = _run(["launch/variance_drift.py", "--steps", "4", "--freeze-step", "2", "--at", "2,4",
                 "--refresh-steps", "2", "--refresh-decay", "0.5", "--floor", "0",
                 "--json", str(out), "--plot", str(png)])
    assert "off >2x" in text and "refreshed every 2" in text and png.stat().st_size > 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["step"] for r in rows] == [2, 4]
    for key in ("per_tensor", "refreshed_per_tensor"):
        assert all(abs(v - 1.0) < 1e-6 for v in rows[0][key].values() if v == v)
        assert any(abs(v - 1.0) > 1e-4 for v in rows[1][key].values() if v == v)
    # the refresh at step 4 (0-based 3 = freeze + R - 1) moved the reference: the ratios differ from the frozen's
    assert any(abs(a - b) > 1e-4 for a, b in zip(rows[1]["per_tensor"].values(), rows[1]["refreshed_per_tensor"].values())
               if a == a and b == b)
