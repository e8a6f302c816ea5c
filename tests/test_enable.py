"""``ds_dragonn.enable()``: plain ``deepspeed.initialize`` (the call frameworks make) honours the "dragonn" block.

2 ranks (gloo), ZeRO 0 and 2: compressed reductions happen, density 1.0 equals the dense run bit for bit,
configs without an enabled block get DeepSpeed's engine untouched, and before ``enable()`` the block is
ignored (the silent failure this exists to fix)."""
from __future__ import annotations

import pytest
import torch

from tests.enable_cases import STEPS
from tests.multiproc import ranks_fixture


runs = ranks_fixture("tests.enable_cases:enabled_runs", "enable", pool="gloo")


def test_without_enable_the_block_is_ignored(runs):
    for r in range(2):
        assert runs[r]["before"]["compressed"] is None  # no hook: DeepSpeed's dense engine


def test_enable_is_idempotent_keeps_the_signature_and_is_undone_by_disable(runs):
    for r in range(2):
        assert runs[r]["wrapped_once"] and runs[r]["same_signature"] and runs[r]["restored"]


def test_another_wrapper_on_top_keeps_working_after_disable(runs):
    """A framework's own wrapper around ours, then ``disable()``: no recursion, the engine hooked once."""
    for r in range(2):
        assert runs[r]["foreign_wrapper"]["compressed"] >= STEPS
        assert runs[r]["foreign_wrapper_via_ds_dragonn"]


@pytest.mark.parametrize("stage", [0, 2])
def test_plain_initialize_compresses_after_enable(runs, stage):
    for r in range(2):
        got = runs[r][f"s{stage}_d001"]
        assert got["n_results"] == 4 and got["engine_type"] == "DeepSpeedEngine"
        assert got["compressed"] and got["compressed"] >= STEPS


@pytest.mark.parametrize("stage", [0, 2])
def test_density_1_equals_the_dense_run(runs, stage):
    for r in range(2):
        d1, dense = runs[r][f"s{stage}_d1"], runs[r][f"s{stage}_dense"]
        assert d1["compressed"] >= STEPS and dense["compressed"] is None
        assert all(torch.equal(a, b) for a, b in zip(d1["params"], dense["params"]))


def test_configs_without_an_enabled_block_are_untouched(runs):
    for r in range(2):
        assert runs[r]["s0_disabled_block"]["compressed"] is None
        assert all(torch.equal(a, b) for a, b in zip(runs[r]["s0_disabled_block"]["params"], runs[r]["s0_dense"]["params"]))


@pytest.mark.parametrize("name, dense, patched", [
    ("s0_disabled_engine", "s0_dense", {"DeepSpeedEngine.allreduce_bucket", "DeepSpeedEngine.allreduce_and_copy",
                                        "DeepSpeedEngine.save_checkpoint", "dragonn"}),
    ("s2_disabled_engine", "s2_dense", {"DeepSpeedZeroOptimizer.average_tensor", "dragonn"}),
    ("s0_momentum_disabled_engine", "s0_momentum_dense", {"DeepSpeedEngine.allreduce_bucket", "dragonn"})])
def test_disable_of_an_engine_removes_every_patch_and_trains_as_deepspeed(runs, name, dense, patched):
    """``disable(engine)`` right after ``initialize``: nothing of ds_dragonn is left on the engine, its optimizer
    or overflow checker, and the run equals DeepSpeed's dense engine bit for bit (the momentum mode: also
    its optimizer step pre-hook is gone, else Adam's variance would be frozen)."""
    for r in range(2):
        got = runs[r][name]
        assert patched <= set(got["patched"]), got["patched"]
        assert got["left"] == [] and got["compressed"] is None
        assert all(torch.equal(a, b) for a, b in zip(got["params"], runs[r][dense]["params"]))


def test_disable_under_local_steps_brings_the_ranks_back_to_one_state(runs):
    """Between syncs each rank holds its own weights and Adam state; after ``disable(engine)`` the ranks take rank
    0's, so the dense steps that follow keep them identical (without it they stay apart for good)."""
    a, b = runs[0]["local_steps_disabled"], runs[1]["local_steps_disabled"]
    assert not torch.equal(a["weights"][3], b["weights"][3])  # a local step: the ranks differ before disable
    for wa, wb in zip(a["weights"][4:], b["weights"][4:]):
        assert torch.isfinite(wa).all() and torch.equal(wa, wb)
    assert a["left"] == [] and b["left"] == []


def test_python_m_ds_dragonn_prints_the_environment_report():
    import subprocess
    import sys

    from tests.multiproc import REPO
    proc = subprocess.run([sys.executable, "-m", "ds_dragonn"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0] for line in proc.stdout.splitlines() if line.strip()}
    assert {"python", "ds_dragonn", "torch", "deepspeed", "cpu", "triton", "mpi", "transformers"} <= rows, proc.stdout


@pytest.mark.parametrize("engine", ["x", object(), 3])
def test_disable_of_something_that_is_not_an_engine_says_what_it_expected(engine):
    import ds_dragonn
    with pytest.raises(TypeError, match="expected the DeepSpeed engine that ds_dragonn.initialize returned"):
        ds_dragonn.disable(engine)
