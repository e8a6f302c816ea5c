"""The main job under the real ``deepspeed`` launcher on 2 local ranks (short run)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.multiproc import PORT_ATTEMPTS, REPO, free_port, port_was_taken

KEYS = {"world_size", "steps", "dragonn_enabled", "density", "test_accuracy", "final_loss", "bytes_sent",
        "dense_bytes_equivalent", "compress_ms_mean"}


@pytest.mark.timeout(480)  # 400 s for the run, plus a quick failed start on a taken port
def test_deepspeed_launcher_runs_main_job(tmp_path):
    launcher = shutil.which("deepspeed") or os.path.join(os.path.dirname(sys.executable), "deepspeed")
    summary = tmp_path / "summary.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    for _ in range(PORT_ATTEMPTS):  # a fresh port again only if another process bound this one first
        port = free_port()
        cmd = [launcher, "--num_gpus", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
               "launch/train.py", "--deepspeed_config", "configs/dragonn.json", "--steps", "60",
               "--log-interval", "20", "--summary", str(summary)]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
        if proc.returncode == 0 or not port_was_taken(proc.stdout + proc.stderr, port):
            break
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "DRAGONN enabled" in proc.stdout + proc.stderr
    s = json.loads(summary.read_text())
    assert KEYS <= set(s)
    assert s["world_size"] == 2 and s["steps"] == 60 and s["dragonn_enabled"] and s["density"] == 0.01
    assert s["compressed_reductions"] == 60
    # about the density: candidates are raised by the expected collision loss (candidate_density)
    assert 0.007 < s["achieved_density"] <= 0.013
    assert 0 < s["bytes_sent"] <= 0.03 * s["dense_bytes_equivalent"]
    assert s["test_accuracy"] > 0.5  # 60 steps of a 10-class problem: far above chance (0.1)


def test_compare_flags_missed_targets(tmp_path):
    base = {"world_size": 2, "steps": 10, "density": 1.0, "final_loss": 0.1, "compress_ms_mean": 0.0}
    (tmp_path / "d.json").write_text(json.dumps(dict(base, test_accuracy=0.98, bytes_sent=100,
                                                     dense_bytes_equivalent=100)))
    (tmp_path / "c.json").write_text(json.dumps(dict(base, density=0.01, test_accuracy=0.95, bytes_sent=2,
                                                     dense_bytes_equivalent=100)))
    cmd = [sys.executable, "launch/compare.py", str(tmp_path / "d.json"), str(tmp_path / "c.json"),
           "--json", str(tmp_path / "out.json")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 1 and "MISSED" in proc.stdout
    out = json.loads((tmp_path / "out.json").read_text())["runs"]["c"]
    assert not out["accuracy_ok"] and out["bytes_ok"] and abs(out["accuracy_gap_pp"] - 3.0) < 1e-9
    (tmp_path / "p.json").write_text(json.dumps(dict(base, density=0.01, test_accuracy=0.975, bytes_sent=2,
                                                     dense_bytes_equivalent=100, exchange="partitioned",
                                                     dragonn_enabled=True)))
    cmd.insert(4, str(tmp_path / "p.json"))
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 1 and "partitioned" in proc.stdout  # c still misses
    runs = json.loads((tmp_path / "out.json").read_text())["runs"]
    assert runs["p"]["accuracy_ok"] and runs["p"]["bytes_ok"] and not runs["c"]["accuracy_ok"]


@pytest.mark.timeout(480)
def test_lm_task_runs_under_the_launcher(tmp_path):
    """launch/train_lm.py (the second task), a tiny GPT (85k parameters: one compressed bucket above
    min_compress_numel) for 4 steps: held-out loss in the summary. The product's config without its warm-ups
    (4 steps would all be dense), so that every step is compressed at the target density."""
    import math
    launcher = shutil.which("deepspeed") or os.path.join(os.path.dirname(sys.executable), "deepspeed")
    summary = tmp_path / "lm.json"
    cfg = json.loads((REPO / "configs" / "lm_dragonn.json").read_text())
    cfg["dragonn"].update(warmup_steps=0, density_warmup_steps=0)
    (tmp_path / "lm_dragonn.json").write_text(json.dumps(cfg))
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    for _ in range(PORT_ATTEMPTS):
        port = free_port()
        cmd = [launcher, "--num_gpus", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
               "launch/train_lm.py", "--deepspeed_config", str(tmp_path / "lm_dragonn.json"), "--steps", "4",
               "--log-interval", "2", "--n-layer", "1", "--d-model", "64", "--n-head", "2", "--ctx", "32",
               "--eval-windows", "8", "--summary", str(summary)]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
        if proc.returncode == 0 or not port_was_taken(proc.stdout + proc.stderr, port):
            break
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert s["task"] == "lm" and s["metric"] == "test_loss" and s["world_size"] == 2 and s["steps"] == 4
    assert [h["step"] for h in s["history"]] == [2, 4]
    assert math.isfinite(s["test_loss"]) and 0 < s["test_loss"] < math.log(256) + 1.0  # nats/byte
    assert s["compressed_reductions"] == 4 and 0 < s["bytes_sent"] < 0.05 * s["dense_bytes_equivalent"]


def test_lm_corpus_split_is_fixed_and_disjoint():
    sys.path.insert(0, str(REPO / "launch"))
    try:
        from train_lm import stdlib_corpus
    finally:
        sys.path.pop(0)
    train, held = stdlib_corpus(max_train_bytes=1 << 20)
    again_train, again_held = stdlib_corpus(max_train_bytes=1 << 20)
    assert train.numel() == 1 << 20 and held.numel() > 100_000
    assert torch.equal(train, again_train) and torch.equal(held, again_held)
    # independently: the held-out text is every 10th file (sorted by path), each followed by a 0 byte
    import sysconfig
    from pathlib import Path
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts)
    want = b"".join(p.read_bytes() + b"\0" for p in files[9::10])
    assert bytes(held.tolist()) == want
    assert bytes(train[:len(files[0].read_bytes())].tolist()) == files[0].read_bytes()


@pytest.mark.timeout(600)
def test_convergence_quick_sweep(tmp_path):
    """``launch/convergence.sh --quick`` (dense and the defaults; the quick sweep's third run, ``legacy_0.01``,
    is the same path with other keys) on the LM through the deepspeed launcher: records with the sweep's fields,
    a table and a figure; about 30 s on 2 cores. (The classifier task is launch/train.py, the main job: its
    launch is test_deepspeed_launcher_runs_main_job.)"""
    out = tmp_path / "conv"
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    cmd = ["bash", "launch/convergence.sh", "--quick", "--tasks", "lm", "--runs", "dense,dragonn_0.01", "--out",
           str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "convergence.json").read_text())
    recs = data["records"]
    fields = {"task", "run", "selection", "exchange", "density", "error_feedback", "warmup", "seed", "steps",
              "metric", "value", "bytes_sent", "dense_bytes_equivalent", "wall_s"}
    assert {(r["task"], r["run"]) for r in recs} == {("lm", r) for r in ("dense", "dragonn_0.01")}
    for r in recs:
        assert fields <= set(r), fields - set(r)
        assert r["metric"] == "test_loss"
        assert r["value"] == r["value"] and r["history"] and r["history"][-1]["step"] == r["steps"]
        if r["run"] == "dense":
            assert r["bytes_sent"] == r["dense_bytes_equivalent"] and r["selection"] is None
        else:
            assert 0 < r["bytes_sent"] < r["dense_bytes_equivalent"]
            assert r["selection"] == "global"
            assert r["warmup"]["warmup_steps"] > 0  # the defaults' dense warm-up, shortened by --quick
    assert "| dragonn_0.01 |" in (out / "convergence.md").read_text()
    assert (out / "convergence.png").stat().st_size > 10_000


def _two_node_launch(tmp_path, dragonn: dict, steps: int = 12, nodes: int = 2, ds: dict | None = None) -> dict:
    """``nodes`` (two by default) ``deepspeed --hostfile H --no_ssh --node_rank i`` launchers on this host
    (loopback), 2 ranks each: the launcher's own multi-node mode, as SLURM / Kubernetes users run it. Returns
    rank 0's summary."""
    launcher = shutil.which("deepspeed") or os.path.join(os.path.dirname(sys.executable), "deepspeed")
    (tmp_path / "hostfile").write_text("".join(f"node{i} slots=2\n" for i in range(nodes)))
    cfg = json.loads((REPO / "configs" / "dragonn.json").read_text())
    cfg["dragonn"].update(dragonn)
    cfg.update(ds or {})
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    summary = tmp_path / "summary.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    for _ in range(PORT_ATTEMPTS):
        port = free_port()
        procs = [subprocess.Popen([launcher, "--hostfile", str(tmp_path / "hostfile"), "--no_ssh", "--node_rank",
                                   str(i), "--master_addr", "127.0.0.1", "--master_port", str(port),
                                   "launch/train.py", "--deepspeed_config", str(tmp_path / "ds.json"), "--steps",
                                   str(steps), "--log-interval", str(steps), "--summary", str(summary)],
                                  cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for i in range(nodes)]
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=400)[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise
        text = "\n".join(outs)
        if all(p.returncode == 0 for p in procs) or not port_was_taken(text, port):
            break
    assert all(p.returncode == 0 for p in procs), text[-4000:]
    return json.loads(summary.read_text()), text


@pytest.mark.timeout(900)
def test_two_launchers_with_node_ranks_run_the_node_aware_exchange(tmp_path):
    """2 nodes x 2 ranks from two launcher invocations: 'hierarchy': 'auto' finds the layout in the launcher's
    LOCAL_SIZE and logs its choice; the ranks end bit-identical, in both the node-aware and the flat run."""
    node, log = _two_node_launch(tmp_path, {"hierarchy": "auto"})
    assert node["world_size"] == 4 and node["hierarchy"] == "2 nodes x 2 ranks" and node["ranks_in_sync"]
    assert "hierarchy 'auto' -> node-aware: 2 nodes x 2 ranks (the launcher)" in log
    assert node["compressed_reductions"] == 12
    flat, log = _two_node_launch(tmp_path, {"hierarchy": "flat"})
    assert flat["hierarchy"] == "flat" and flat["ranks_in_sync"]
    assert 0 < node["bytes_sent"] < flat["bytes_sent"] / 2 * 1.15  # one shard per rank: 1/L of the bytes


@pytest.mark.timeout(900)
def test_three_launchers_run_three_nodes_of_two_at_zero_2(tmp_path):
    """3 nodes x 2 ranks at ZeRO 2 with the partitioned exchange across nodes: the layout from three launchers,
    the ranks bit-identical."""
    node, log = _two_node_launch(tmp_path, {"hierarchy": "node", "exchange": "partitioned"}, steps=8, nodes=3,
                                 ds={"zero_optimization": {"stage": 2}})
    assert node["world_size"] == 6 and node["hierarchy"] == "3 nodes x 2 ranks" and node["ranks_in_sync"]
    assert node["zero_stage"] == 2
    assert "hierarchy 'node' -> node-aware: 3 nodes x 2 ranks (the launcher)" in log
    assert node["compressed_reductions"] == 8
