"""The time-to-target benchmark (launch/bench_ttq.py, bench_ttq.sh): its target and report logic on synthetic
records, its quick lane end to end (the quality phase and the report), and the throttled timing phase where
root and network namespaces are available. Plumbing only: no assertion on any timing."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "launch"))
import bench_ttq as ttq  # noqa: E402

ROW_KEYS = {"mode", "link", "target_loss", "steps_to_target", "median_step_ms", "time_to_target_s", "final_loss",
            "bytes_per_step", "curve", "gap_vs_dense_pct", "final_gap_to_target_pct", "x_vs_ds_bf16"}
MODEL = {"n_layer": 1, "d_model": 64, "n_head": 2, "ctx": 32, "micro_batch": 8, "gradient_accumulation": 2}


def curve(losses, every=10):
    return [{"step": every * (i + 1), "loss": v} for i, v in enumerate(losses)]


def quality(mode, losses, dense_warmup_steps=0, reference=False):
    c = curve(losses)
    return {"phase": "quality", "mode": mode, "reference": reference, "world_size": 2, "seed": 1, "model": MODEL,
            "steps": c[-1]["step"], "curve": c, "final_loss": c[-1]["loss"], "bytes_per_step": 1e6,
            "dense_warmup_steps": dense_warmup_steps}


def timing(mode, link, ms, dense_ms=None):
    return {"phase": "timing", "mode": mode, "link": link, "world_size": 2, "seed": 1, "model": MODEL,
            "median_step_ms": ms, "dense_step_ms": dense_ms, "bytes_per_step": 2e5, "tx_bytes_per_step": None,
            "timed_telemetry": None}


# -- target and report logic on synthetic curves --------------------------------------------------------
def test_loss_at_and_steps_to_target_interpolate():
    c = curve([4.0, 3.0, 2.5, 2.0, 1.8])  # steps 10..50
    assert ttq.loss_at(c, 40) == 2.0                      # an evaluation step
    assert ttq.loss_at(c, 15) == pytest.approx(3.5)       # halfway between 10 and 20
    assert ttq.loss_at(c, 5) == 4.0 and ttq.loss_at(c, 99) == 1.8  # clamped
    assert ttq.steps_to_target(c, 2.5) == 30              # reached exactly at an evaluation
    assert ttq.steps_to_target(c, 2.75) == pytest.approx(25.0)  # between 20 (3.0) and 30 (2.5)
    assert ttq.steps_to_target(c, 5.0) == 10              # the first evaluation is already there
    assert ttq.steps_to_target(c, 1.0) is None            # never


def test_steps_to_target_takes_the_first_crossing():
    c = curve([3.0, 2.0, 2.6, 1.9])
    assert ttq.steps_to_target(c, 2.1) == pytest.approx(10 + 10 * 0.9 / 1.0)


def test_seconds_charge_the_dense_warm_up_at_its_own_step_time():
    assert ttq.seconds_at(100, 50.0) == 5.0
    assert ttq.seconds_at(100, 50.0, dense_ms=200.0, dense_steps=30) == pytest.approx((30 * 200 + 70 * 50) / 1e3)
    assert ttq.seconds_at(20, 50.0, dense_ms=200.0, dense_steps=30) == pytest.approx(20 * 200 / 1e3)
    assert ttq.seconds_at(100, 50.0, dense_ms=None, dense_steps=30) == 5.0
    # variance refreshes after the warm-up (steps 30 + 9, + 19, ...): 30 + 7 dense steps among the first 100
    assert ttq.seconds_at(100, 50.0, dense_ms=200.0, dense_steps=30, refresh_steps=10) == pytest.approx(
        (37 * 200 + 63 * 50) / 1e3)
    assert ttq.seconds_at(39, 50.0, 200.0, 30, 10) == pytest.approx((30 * 200 + 9 * 50) / 1e3)  # before the first
    assert ttq.seconds_at(40, 50.0, 200.0, 30, 10) == pytest.approx((31 * 200 + 9 * 50) / 1e3)  # step 39 counted


@pytest.mark.parametrize("refresh", [0, 40])
@pytest.mark.parametrize("step", [0.0, 1.0, 30.0, 30.5, 31.0, 47.25, 70.0, 70.5, 130.0, 131.0, 500.0])
def test_seconds_at_charges_the_density_warmup_between_the_steady_and_the_dense_step(step, refresh):
    """Float64 reference, written out per step: warm-up step j (density d(j) = s (d/s)^(j/W)) costs the steady
    ms plus (dense - steady) times its place between d and s; nothing after the W steps; a variance refresh
    (steps warm + kR - 1) costs one dense step, once; fractional steps pro rata (a refresh when complete)."""
    ms, dense_ms, warm, w, s0, d = 50.0, 200.0, 30, 100, 0.25, 0.01
    ramp = {"steps": w, "start": s0, "density": d}
    total, t = 0.0, 0.0
    while t < step:
        f = min(1.0, step - t)
        i = int(t)
        if i < warm:
            total += f * dense_ms
        elif refresh and (i - warm + 1) % refresh == 0 and f == 1.0:
            total += dense_ms
        elif i - warm < w:
            dj = s0 * (d / s0) ** ((i - warm) / w)
            total += f * (ms + (dense_ms - ms) * (dj - d) / (s0 - d))
        else:
            total += f * ms
        t += f
    assert ttq.seconds_at(step, ms, dense_ms, warm, refresh, ramp) == pytest.approx(total / 1e3, rel=1e-12,
                                                                                    abs=1e-12)
    # bounded by the all-steady and all-dense charges after the dense warm-up; step 30 (d = s) costs a dense step
    plain = ttq.seconds_at(step, ms, dense_ms, warm, refresh)
    assert plain <= ttq.seconds_at(step, ms, dense_ms, warm, refresh, ramp) <= step * dense_ms / 1e3 + 1e-12
    if step >= warm + 1:
        assert ttq.seconds_at(warm + 1, ms, dense_ms, warm, 0, ramp) == pytest.approx((warm + 1) * dense_ms / 1e3)


def test_seconds_at_density_warmup_absent_or_free():
    ramp = {"steps": 100, "start": 0.25, "density": 0.01}
    assert ttq.seconds_at(80, 50.0, 200.0, 30, 0, None) == ttq.seconds_at(80, 50.0, 200.0, 30)
    assert ttq.seconds_at(80, 50.0, 200.0, 30, 0, {"steps": 0, "start": 0.25, "density": 0.01}) == \
        ttq.seconds_at(80, 50.0, 200.0, 30)
    # a dense step no slower than the compressed one: no surcharge (never a discount)
    assert ttq.seconds_at(80, 50.0, 40.0, 30, 0, ramp) == ttq.seconds_at(80, 50.0, 40.0, 30)
    assert ttq.seconds_at(80, 50.0, None, 30, 0, ramp) == 80 * 50.0 / 1e3
    # a start at or below the density: the schedule has no density warm-up, so no charge (and no 0/0)
    for start in (0.01, 0.005):
        assert ttq.seconds_at(80, 50.0, 200.0, 30, 0, {"steps": 100, "start": start, "density": 0.01}) == \
            ttq.seconds_at(80, 50.0, 200.0, 30)


@pytest.mark.parametrize("bad", [{"start": 0.25, "density": 0.01}, {"steps": 100, "density": 0.01},
                                 {"steps": 100, "start": 0.25}, {"steps": -1, "start": 0.25, "density": 0.01}])
def test_seconds_at_refuses_a_malformed_density_warmup(bad):
    with pytest.raises(ValueError, match="density_warmup"):
        ttq.seconds_at(80, 50.0, 200.0, 30, 0, bad)


def synthetic_records():
    q = [quality("ds_fp32", [4.0, 3.0, 2.5, 2.0, 1.8]),             # target: loss at step 40 = 2.0
         quality("ds_bf16", [4.0, 3.0, 2.5, 2.1, 1.9]),             # reaches 2.0 at 45 (interpolated)
         quality("dragonn", [4.2, 3.2, 2.6, 2.2, 1.95], 30),        # at 48
         quality("slow", [4.5, 3.9, 3.5, 3.2, 3.0]),                # never: final gap +50 %
         quality("none", [4.0, 3.0, 2.5, 2.0, 1.7], reference=True)]
    t = [timing("ds_fp32", "100mbit", 600.0), timing("ds_bf16", "100mbit", 300.0),
         timing("dragonn", "100mbit", 60.0, dense_ms=320.0), timing("slow", "100mbit", 10.0),
         timing("none", "100mbit", 40.0),
         timing("ds_fp32", "1gbit", 65.0), timing("ds_bf16", "1gbit", 70.0), timing("dragonn", "1gbit", 60.0, 60.0)]
    return q, t


def test_rows_target_steps_seconds_gaps_and_ratios():
    q, t = synthetic_records()
    rows = ttq.build_rows(q, t)
    by = {(r["mode"], r["link"]): r for r in rows}
    assert [r["link"] for r in rows][0] == "100mbit"  # slowest link first
    for r in rows:
        assert r["target_loss"] == pytest.approx(2.0) and r["target_step"] == pytest.approx(40.0)
        assert ROW_KEYS <= set(r)
    d = by[("dragonn", "100mbit")]
    assert d["steps_to_target"] == pytest.approx(48.0)
    assert d["time_to_target_s"] == pytest.approx((30 * 320 + 18 * 60) / 1e3)
    b = by[("ds_bf16", "100mbit")]
    assert b["steps_to_target"] == pytest.approx(45.0) and b["time_to_target_s"] == pytest.approx(45 * 0.3)
    assert d["x_vs_ds_bf16"] == pytest.approx(b["time_to_target_s"] / d["time_to_target_s"])
    slow = by[("slow", "100mbit")]
    assert slow["steps_to_target"] is None and slow["time_to_target_s"] is None and slow["x_vs_ds_bf16"] is None
    assert slow["final_gap_to_target_pct"] == pytest.approx(50.0)
    assert by[("ds_fp32", "100mbit")]["gap_vs_dense_pct"] == 0.0
    assert d["gap_vs_dense_pct"] == pytest.approx(100 * (1.95 - 1.8) / 1.8)
    assert by[("slow", "1gbit")]["median_step_ms"] is None  # not timed there: no seconds
    assert [c["seconds"] for c in d["curve"]][:1] == [pytest.approx(10 * 0.32)]


def test_lr_sets_every_modes_peak_learning_rate():
    cfg = ttq.lm_config(400, lr=3e-3)
    assert cfg["optimizer"]["params"]["lr"] == cfg["scheduler"]["params"]["warmup_max_lr"] == 3e-3
    assert ttq.lm_config(400)["optimizer"]["params"]["lr"] == json.loads(ttq.BASE_CONFIG.read_text())[
        "optimizer"]["params"]["lr"]
    import torch
    opt, sched = ttq.lm_recipe(cfg).optimizer([torch.nn.Parameter(torch.zeros(3))])  # the torch modes' recipe
    for _ in range(cfg["scheduler"]["params"]["warmup_num_steps"]):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(3e-3, rel=0.02)  # the peak, at the end of the warm-up


def test_rows_refuse_quality_records_at_different_learning_rates():
    q, t = synthetic_records()
    assert {r["lr"] for r in ttq.build_rows(q, t)} == {None}  # older records: no learning rate anywhere
    for r in q:
        r["lr"] = 2e-3
    rows = ttq.build_rows(q, t)
    assert {r["lr"] for r in rows} == {2e-3} and "Peak learning rate (every mode's quality run): 0.002" in \
        ttq.report_text(rows)
    q[1]["lr"] = 1e-3
    with pytest.raises(ValueError, match="different learning rates: .*ds_bf16 0.001"):
        ttq.build_rows(q, t)
    # an older record's config: the schedule's peak, not the optimizer's starting lr
    q[1]["lr"], q[1]["config"] = None, {"optimizer": {"params": {"lr": 2e-3}},
                                        "scheduler": {"params": {"warmup_max_lr": 1e-3}}}
    with pytest.raises(ValueError, match="ds_bf16 0.001"):
        ttq.build_rows(q, t)
    q[1]["config"] = None  # an older torch-mode record: no learning rate at all, beside records that have one
    with pytest.raises(ValueError, match="no learning rate in the quality record.* of ds_bf16"):
        ttq.build_rows(q, t)
    q[1]["config"] = {"optimizer": None}  # malformed: no crash, no learning rate
    assert ttq.record_lr(q[1]) is None
    q[1]["lr"] = 2e-3 * (1 + 1e-12)  # float noise is one learning rate
    assert {r["lr"] for r in ttq.build_rows(q, t)} == {2e-3}
    assert ttq.peak_lr(ttq.lm_config(400, lr=3e-3)) == 3e-3


def test_verdict_names_winner_margin_and_cause():
    q, t = synthetic_records()
    rows = ttq.build_rows(q, t)
    slow = ttq.verdict([r for r in rows if r["link"] == "100mbit"])
    assert slow.startswith("dragonn wins") and "runner-up ds_bf16" in slow and "why: step time" in slow
    assert "none" not in slow.split(";")[0]  # the yardstick never wins, though it is fastest
    fast = ttq.verdict([r for r in rows if r["link"] == "1gbit"])
    assert fast.startswith("ds_fp32 wins") and "runner-up dragonn" in fast and "why: steps" in fast
    text = ttq.report_text(rows)
    assert "not reached (+50.0 %)" in text and "Method:" in text and "-> 100mbit: dragonn wins" in text


def test_rows_without_timing_and_without_reference():
    q, _ = synthetic_records()
    rows = ttq.build_rows(q, [])
    assert {r["link"] for r in rows} == {None} and all(r["time_to_target_s"] is None for r in rows)
    assert "quality phase only" in ttq.report_text(rows)
    with pytest.raises(ValueError, match="ds_fp32"):
        ttq.build_rows(q[1:], [])
    other = dict(q[1], model=dict(MODEL, d_model=128))
    with pytest.raises(ValueError, match="different set-ups"):
        ttq.build_rows([q[0], other], [])


def test_report_writes_table_json_and_png(tmp_path, capsys):
    q, t = synthetic_records()
    for rec in q:
        (tmp_path / "records" / "quality").mkdir(parents=True, exist_ok=True)
        (tmp_path / "records" / "quality" / f"{rec['mode']}.json").write_text(json.dumps(rec))
    for rec in t:
        (tmp_path / "records" / "timing").mkdir(parents=True, exist_ok=True)
        (tmp_path / "records" / "timing" / f"{rec['mode']}@{rec['link']}.json").write_text(json.dumps(rec))
    assert ttq.main(["report", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "== link 100mbit" in out and "== link 1gbit" in out and "-> 1gbit: ds_fp32 wins" in out
    data = json.loads((tmp_path / "bench_ttq.json").read_text())
    assert data["verdicts"]["100mbit"].startswith("dragonn wins") and len(data["records"]) == 10
    assert (tmp_path / "bench_ttq.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="--lr 0.5: the quality records .* ran at"):  # not ignored
        ttq.main(["report", "--out", str(tmp_path), "--lr", "0.5"])


# -- the mode registry and the command line -------------------------------------------------------------
def test_registry_and_mode_definitions():
    modes = ttq.resolve_modes(["ds_fp32", "dragonn"], ['mine={"dragonn": {"enabled": true, "density": 0.05}}'])
    assert [m.name for m in modes] == ["ds_fp32", "dragonn", "mine"]
    cfg = modes[2].config(ttq.lm_config(100))
    assert cfg["dragonn"] == {"enabled": True, "density": 0.05} and cfg["bf16"] == {"enabled": True}
    assert cfg["scheduler"]["params"]["total_num_steps"] == 100
    assert ttq.REGISTRY["ds_fp32"].config({})["communication_data_type"] == "fp32"
    assert ttq.REGISTRY["dragonn_zero2"].config(ttq.lm_config(100))["zero_optimization"] == {"stage": 2}
    for bad, match in ((["nope"], "unknown mode 'nope'"), (["ds_fp32", "ds_fp32"], "given twice")):
        with pytest.raises(ValueError, match=match):
            ttq.resolve_modes(bad, [])
    for bad, match in (("x", "expected NAME=JSON"), ("x={", "does not parse"), ("x=[1]", "must be an object"),
                       ("dragonn={}", "built-in")):
        with pytest.raises(ValueError, match=match):
            ttq.parse_mode_def(bad)


def test_phase_configs():
    cfg = ttq.REGISTRY["dragonn"].config(ttq.lm_config(300))
    assert ttq.phase_config(cfg, "quality", 10)["dragonn"]["policy"] == "always"
    timed = ttq.phase_config(cfg, "timing", 10)["dragonn"]
    assert timed["warmup_steps"] == 10 and timed["density_warmup_steps"] == 0 and "policy" not in timed
    assert ttq.phase_config(ttq.REGISTRY["ds_bf16"].config({}), "quality", 10) == {"communication_data_type": "bf16"}
    assert "policy" not in cfg["dragonn"]  # the registry's config is not changed


def test_local_steps_modes_time_several_outer_steps_and_charge_them_over_the_real_h():
    cfg = ttq.REGISTRY["local_h100_d0.01"].config(ttq.lm_config(300))
    assert cfg["dragonn"]["sync"] == "local_steps" and cfg["dragonn"]["local_steps"] == 100
    timed = ttq.phase_config(cfg, "timing", 10)["dragonn"]
    assert timed["local_steps"] == ttq.TIME_ROUND and timed["warmup_steps"] == 10
    assert ttq.phase_config(cfg, "quality", 10)["dragonn"]["local_steps"] == 100
    # steps 1..40 of a timing run, warm-up 10, rounds of 10: outer steps at 20, 30, 40 cost 50 ms more
    ms = [100.0] * 10 + [10.0 if (s - 10) % 10 else 60.0 for s in range(11, 41)]
    mean, local, overhead = ttq.round_step_ms(ms, first_timed=11, warmup=10, timed_h=10, real_h=100)
    assert (local, overhead) == (10.0, 50.0) and mean == pytest.approx(10.5)
    assert ttq.round_step_ms(ms[:15], 11, 10, 10, 100)[0] is None  # no outer step in the window
    dil = ttq.REGISTRY["diloco_h30"]
    assert dil.config({})["dragonn"]["density"] == 1.0 and dil.config({})["dragonn"]["outer_lr"] == 0.7
    assert not hasattr(dil, "constants")  # no outer momentum to set: diloco_* run plain outer SGD at lr 0.7


def test_untimed_local_steps_modes_borrow_the_outer_overhead_over_their_own_h(tmp_path):
    sys.path.insert(0, str(REPO / "launch" / "bench"))
    import borrow_timing
    (tmp_path / "records" / "quality").mkdir(parents=True)
    (tmp_path / "records" / "timing").mkdir(parents=True)
    cfg = lambda h, d: {"dragonn": {"sync": "local_steps", "local_steps": h, "density": d}}  # noqa: E731
    for mode, h, d in (("a_h30", 30, 0.01), ("b_h100", 100, 0.01), ("c_d01", 30, 0.1)):
        (tmp_path / "records" / "quality" / f"{mode}.json").write_text(json.dumps({"mode": mode, "config": cfg(h, d)}))
    src = {"mode": "a_h30", "link": "100mbit", "config": cfg(10, 0.01), "local_steps": 30, "local_step_ms": 10.0,
           "outer_overhead_ms": 50.0, "median_step_ms": 10.0 + 50 / 30, "bytes_per_step": 300.0, "tx_bytes_per_step": None}
    (tmp_path / "records" / "timing" / "a_h30@100mbit.json").write_text(json.dumps(src))
    assert borrow_timing.borrow(tmp_path) == ["b_h100@100mbit.json"]  # not c_d01: another density
    got = json.loads((tmp_path / "records" / "timing" / "b_h100@100mbit.json").read_text())
    assert got["median_step_ms"] == pytest.approx(10.5) and got["bytes_per_step"] == pytest.approx(90.0)
    assert got["timing_from"] == "a_h30" and got["local_steps"] == 100


def test_bad_flags_are_named(capsys):
    for argv, flag in ((["quality", "--modes", "ds_fp32 bogus"], "bogus"), (["quality", "--eval-every", "0"],
                       "--eval-every"), (["timing", "--link", "1gbit", "--netns", "a b"], "--netns"),
                       (["quality", "--mode", 'bad={"dragonn": {"enabled": true, "density": 2}}'], "mode bad"),
                       (["quality", "--lr", "0"], "--lr"), (["quality", "--lr", "nan"], "--lr"),
                       (["quality", "--lr", "1e300"], "--lr"), (["quality", "--lr", "inf"], "--lr")):
        with pytest.raises(SystemExit):
            ttq.get_args(argv)
        assert flag in capsys.readouterr().err


# -- the quick lane, end to end -------------------------------------------------------------------------
def _env():
    return dict(os.environ, DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def quick_out(tmp_path_factory):
    """The quick lane's quality phase (2 modes, tiny model, 2 ranks on loopback) and report."""
    out = tmp_path_factory.mktemp("ttq")
    for cmd in (["quality", "--quick", "--out", str(out), "--lr", "0.002"], ["report", "--quick", "--out", str(out)]):
        proc = subprocess.run([sys.executable, "launch/bench_ttq.py", *cmd], cwd=REPO, env=_env(),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout


def test_quick_quality_phase_and_report(quick_out):
    out, text = quick_out
    assert "quality phase only" in text and "Method:" in text and "Peak learning rate" in text
    assert "ds_fp32" in text and "dragonn" in text
    for mode in ttq.QUICK_MODES:
        rec = json.loads((out / "records" / "quality" / f"{mode}.json").read_text())
        assert rec["steps"] == ttq.QUICK["steps"] and len(rec["curve"]) == ttq.QUICK["steps"] // ttq.QUICK["eval_every"]
        assert rec["final_loss"] == rec["curve"][-1]["loss"] and rec["bytes_per_step"] > 0
        assert rec["lr"] == 0.002 and rec["config"]["scheduler"]["params"]["warmup_max_lr"] == 0.002  # --lr
    dragonn = json.loads((out / "records" / "quality" / "dragonn.json").read_text())
    assert dragonn["config"]["dragonn"]["policy"] == "always" and dragonn["telemetry"]["compressed_reductions"] > 0
    rows = json.loads((out / "bench_ttq.json").read_text())["records"]
    assert {r["mode"] for r in rows} == set(ttq.QUICK_MODES) and all(ROW_KEYS <= set(r) for r in rows)
    assert (out / "bench_ttq.png").stat().st_size > 0


def _netns_ok() -> bool:
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        return False
    probe = "dragonn_tq_probe"
    ok = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ok


def test_quick_timing_phase_on_a_throttled_link(quick_out):
    if not _netns_ok():
        pytest.skip("needs root and network namespaces (ip netns, tc)")
    out, _ = quick_out
    proc = subprocess.run(["bash", "launch/bench_ttq.sh", "--quick", "--skip-quality", "--out", str(out)],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    if proc.returncode == 75:
        pytest.skip("another link benchmark holds the lock")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "== link 100mbit" in proc.stdout and "-> 100mbit:" in proc.stdout
    for mode in ttq.QUICK_MODES:
        rec = json.loads((out / "records" / "timing" / f"{mode}@100mbit.json").read_text())
        assert rec["median_step_ms"] > 0 and rec["bytes_per_step"] > 0 and rec["tx_bytes_per_step"] > 0
    rows = json.loads((out / "bench_ttq.json").read_text())["records"]
    assert {r["link"] for r in rows} == {"100mbit"} and all(r["median_step_ms"] for r in rows)
    assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.count("dragonn_tq") == 0
