"""``sync: local_steps`` (DiLoCo / SparseLoCo rounds with a DRAGONN-compressed pseudo-gradient): the outer step
against float64 references, the engine at 2 and 3 ranks (bit-identical ranks at every round's end, nothing
lost, telemetry against dense data-parallel training), the dense engine's trajectory as a limit case, exact
resume mid-round, and the refusals."""
from __future__ import annotations

import math

import pytest
import torch

from ds_dragonn.config import DragonnConfig, DragonnConfigError
from ds_dragonn.exchange.wire import dense_allreduce_bytes
from ds_dragonn.outer import OuterStep, outer_lr_for
from tests.local_steps_cases import KEPT, RUNS
from tests.multiproc import load_rank_files, run_ranks


# -- the outer step alone -------------------------------------------------------------------------------
@pytest.mark.parametrize("lr", [1.0, 0.7, 0.3])
def test_outer_step_is_torch_sgd_on_the_pseudo_gradient(lr):
    """θ_outer follows torch.optim.SGD fed the averaged pseudo-gradients as gradients (float64)."""
    gen = torch.Generator().manual_seed(7)
    shapes = [(3, 5), (1,), (0,), (7,)]
    start = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    ref = [torch.nn.Parameter(t.clone()) for t in start]
    sgd = torch.optim.SGD(ref, lr=lr)
    outer = OuterStep(lr)
    outer.start(start)
    for _ in range(4):
        averaged = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
        outer.apply_(averaged)
        for p, d in zip(ref, averaged):
            p.grad = d.clone()
        sgd.step()
    for a, p in zip(outer.anchor, ref):
        torch.testing.assert_close(a.double(), p.detach(), rtol=1e-6, atol=1e-6)
    assert outer.rounds == 4


def test_pseudo_gradient_restart_and_state():
    masters = [torch.arange(6.0).view(2, 3), torch.ones(1)]
    outer = OuterStep(0.5)
    outer.start(masters)
    moved = [m - 0.25 for m in masters]
    deltas = outer.pseudo_gradient(moved)
    assert all(torch.equal(d, torch.full_like(d, 0.25)) for d in deltas)
    outer.apply_(deltas)
    outer.restart_(moved)
    assert all(torch.equal(m, a) for m, a in zip(moved, outer.anchor))
    saved = outer.state_dict()
    other = OuterStep(0.5)
    other.load_state_dict(saved, moved)
    assert all(torch.equal(a, b) for a, b in zip(other.anchor, outer.anchor))
    assert other.rounds == 1 and set(saved) == {"anchor", "rounds", "lr"}
    with pytest.raises(ValueError, match="do not match"):
        outer.pseudo_gradient([torch.ones(6)])
    with pytest.raises(ValueError, match="does not match the master weights"):
        other.load_state_dict(saved, [torch.ones(3)])
    bad = {**saved, "anchor": [torch.full((2, 3), float("nan")), torch.ones(1)]}
    with pytest.raises(ValueError, match="NaN or Inf"):
        other.load_state_dict(bad, moved)
    with pytest.raises(RuntimeError, match="start"):
        OuterStep().pseudo_gradient(masters)
    for lr in (0.0, -0.1):
        with pytest.raises(ValueError, match="outer lr must be > 0"):
            OuterStep(lr)


@pytest.mark.parametrize("setting, workers, lr", [("auto", 1, 1.0), ("auto", 2, 2 ** 0.5), ("auto", 4, 2.0),
                                                   ("auto", 3, 3 ** 0.5), (0.7, 4, 0.7), (2, 2, 2.0)])
def test_outer_lr_for_resolves_auto_to_the_square_root_of_the_workers(setting, workers, lr):
    assert outer_lr_for(setting, workers) == pytest.approx(lr, rel=1e-15)


@pytest.mark.parametrize("setting, workers", [("auto", 0), ("Auto", 2), (None, 2), (True, 2), (0.0, 2), (-1.0, 2)])
def test_outer_lr_for_refuses_what_is_not_a_positive_lr(setting, workers):
    with pytest.raises(ValueError, match="outer_lr"):
        outer_lr_for(setting, workers)


@pytest.mark.parametrize("block,key", [({"local_steps": 0}, "local_steps"), ({"sync": "sometimes"}, "sync"),
                                       ({"outer_momentum": 0.9}, "outer_momentum"), ({"outer_lr": 0.0}, "outer_lr"),
                                       ({"outer_feedback_decay": 1.0}, "outer_feedback_decay"),
                                       ({"local_steps": 3.0}, "local_steps"),
                                       ({"advanced": {"outer_residual": "theta"}}, "advanced.outer_residual")])
def test_config_names_the_bad_key(block, key):
    with pytest.raises(DragonnConfigError, match=f"dragonn.{key}"):
        DragonnConfig.from_ds_config({"dragonn": {"enabled": True, "sync": "local_steps", **block}})


@pytest.mark.parametrize("block,match", [
    ({"local_steps": 8}, "'local_steps' applies to 'sync': 'local_steps' only"),
    ({"outer_lr": 0.7}, "'outer_lr' applies to 'sync': 'local_steps' only"),
    ({"sync": "local_steps", "selection": "per_tensor"}, "'dragonn.selection' belongs under 'advanced'"),
    ({"sync": "local_steps", "outer_feedback_decay": 0.9}, "'dragonn.outer_feedback_decay': unknown key")])
def test_settings_of_the_other_sync_mode_are_refused(block, match):
    with pytest.raises(DragonnConfigError, match=match):
        DragonnConfig.from_ds_config({"dragonn": {"enabled": True, **block}})
    DragonnConfig.from_ds_config({"dragonn": {"enabled": True, "sync": "local_steps", "local_steps": 8,
                                              "exchange": "partitioned", "outer_lr": 0.7}})


def test_a_state_of_the_other_sync_mode_is_reset_naming_sync():
    from ds_dragonn.engine.state import compare
    now = {"world_size": 2, "rank": 0, "bucketing": {}, "parameters": [],
           "dragonn": DragonnConfig(enabled=True, sync="local_steps").model_dump(mode="json"), "exchange": "allgather"}
    saved = {**now, "dragonn": DragonnConfig(enabled=True).model_dump(mode="json")}
    reset, _, _ = compare(saved, now)
    assert any("dragonn.sync every_step (now local_steps)" in r for r in reset)
    assert compare(now, now) == ([], [], [])


def test_config_refuses_the_momentum_mode_with_local_steps():
    with pytest.raises(DragonnConfigError, match="'compress': 'momentum' applies to 'sync': 'every_step'"):
        DragonnConfig.from_ds_config({"dragonn": {"enabled": True, "sync": "local_steps", "compress": "momentum"}})


def test_hook_point_check_fails_loudly_on_a_deepspeed_that_bypasses_it():
    from ds_dragonn.engine.local_steps import check_local_steps_hook_point
    check_local_steps_hook_point()  # the installed DeepSpeed

    class Bypassing:
        def _backward_epilogue(self):
            self.reduce_everything()

        def _take_model_step(self, lr_kwargs):
            self.global_steps += 1

    with pytest.raises(RuntimeError, match="allreduce_gradients"):
        check_local_steps_hook_point(Bypassing)


# -- the engine ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[2, 3])
def rounds(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"rounds{request.param}")
    run_ranks("tests.local_steps_cases:rounds", world_size=request.param, out_dir=out, timeout=400)
    return load_rank_files(out, "rounds", request.param)


@pytest.mark.parametrize("name", [n for n in RUNS if n not in KEPT])
def test_ranks_end_every_round_bit_identical(rounds, name):
    runs = [r[name] for r in rounds]
    count = len(runs[0]["weights"])
    assert count >= 2 and all(len(r["weights"]) == count for r in runs)
    for i in range(count):
        for other in runs[1:]:
            assert all(torch.equal(a, b) for a, b in zip(runs[0]["weights"][i], other["weights"][i])), (name, i)
            assert torch.equal(runs[0]["applied"][i], other["applied"][i])
    # between syncs the ranks trained apart: their pseudo-gradients differ
    assert not torch.equal(runs[0]["delta"][0], runs[1]["delta"][0])


@pytest.mark.parametrize("name", KEPT)
def test_kept_weights_are_theta_outer_minus_the_ranks_residual(rounds, name):
    """``outer_residual: weights``: after every sync θ_outer is bit-identical on every rank, and each rank's fp32
    master weights are exactly ``θ_outer − its residual``; the residuals, and so the weights, differ."""
    runs = [r[name] for r in rounds]
    count = len(runs[0]["anchors"])
    assert count >= 2
    for i in range(count):
        for other in runs[1:]:
            assert torch.equal(runs[0]["anchors"][i], other["anchors"][i]), (name, i)
        for run in runs:
            assert torch.equal(run["masters"][i], run["anchors"][i] - run["kept"][i]), (name, i)
    assert not torch.equal(runs[0]["kept"][-1], runs[1]["kept"][-1])
    assert not torch.equal(runs[0]["weights"][-1][0], runs[1]["weights"][-1][0])


@pytest.mark.parametrize("name", [n for n in KEPT if "bf16" not in n])
def test_nothing_lost_over_the_rounds(rounds, name):
    """float64: Σ_ranks residual = Σ_rounds (Σ_ranks Δ_r − P·Δ̄_r) (what was applied × P plus every residual,
    server residuals included, is every pseudo-gradient); θ_outer = θ_0 minus the outer steps of the applied Δ̄
    (a float64 outer-SGD reference)."""
    world = len(rounds)
    runs = [r[name] for r in rounds]
    block = RUNS[name][0]
    lr = block.get("outer_lr", "auto")
    lr = _auto_lr(block, world) if lr == "auto" else lr
    total = len(runs[0]["applied"])
    expected = torch.zeros_like(runs[0]["delta"][0])
    for i in range(total):
        # kept in the weights: a round starts from θ_outer − residual, so its own progress is Δ − that residual
        own = [r["delta"][i] - (r["kept"][i - 1].double() if name in KEPT and i else 0.0) for r in runs]
        expected = expected + sum(own) - world * runs[0]["applied"][i]
    held = sum(r["residual"] + r["server"] for r in runs)
    if name.startswith("partitioned"):
        assert any(r["server"].abs().sum() > 0 for r in runs)  # the owners held something back
    torch.testing.assert_close(held, expected, rtol=1e-5, atol=1e-5)
    anchor = runs[0]["anchor0"].clone()
    for applied in runs[0]["applied"]:
        anchor -= lr * applied
    torch.testing.assert_close(torch.cat([a.flatten().double() for a in runs[0]["anchor"]]), anchor,
                               rtol=1e-5, atol=1e-5)


def _auto_lr(block: dict, workers: int) -> float:
    """``outer_lr`` "auto": √(workers), at least 2 for a compressed Δ (the cases' density is 0.1 unless set)."""
    return math.sqrt(workers) if block.get("density", 0.1) >= 1.0 else max(2.0, math.sqrt(workers))


@pytest.mark.parametrize("name", list(RUNS))
def test_outer_lr_auto_is_the_square_root_of_the_workers(rounds, name):
    """``outer_lr`` "auto" (the default): √(ranks) on the flat layout, every rank one worker, at least 2 for a
    compressed Δ; a number as given."""
    given = RUNS[name][0].get("outer_lr", "auto")
    for r in rounds:
        assert r[name]["outer_lr"] == (_auto_lr(RUNS[name][0], len(rounds)) if given == "auto" else given)


@pytest.mark.parametrize("name", list(RUNS))
def test_bytes_are_counted_against_dense_data_parallel_training(rounds, name):
    world = len(rounds)
    run = rounds[0][name]
    t = run["telemetry"]
    dense_step = dense_allreduce_bytes(run["numel"], run["itemsize"], world)
    warmup = RUNS[name][0].get("warmup_steps", 2)
    assert t["dense_bytes_equivalent"] == run["steps"] * dense_step
    assert t["dense_reductions"] == warmup and t["local_steps_taken"] == run["steps"] - warmup
    assert t["outer_syncs"] == len(run["applied"]) == (run["steps"] - warmup) // RUNS[name][0].get("local_steps", 3)
    assert t["bytes_sent"] == warmup * dense_step + t["outer_bytes_sent"]
    if RUNS[name][0].get("density") == 1.0:
        assert t["outer_bytes_sent"] == t["outer_syncs"] * dense_allreduce_bytes(run["numel"], run["itemsize"], world)
    else:
        assert 0 < t["outer_bytes_sent"] < t["outer_syncs"] * dense_step
    assert t["bytes_ratio"] == pytest.approx(t["bytes_sent"] / t["dense_bytes_equivalent"])


def test_one_local_sgd_step_per_round_is_dense_training(tmp_path):
    """SGD, density 1.0, H = 1, outer lr 1: each round applies the mean of the ranks' steps, i.e. dense
    data-parallel SGD (up to fp32 rounding of θ − (θ − lr·g))."""
    run_ranks("tests.local_steps_cases:sgd_equivalence", world_size=2, out_dir=tmp_path, timeout=300)
    for r in load_rank_files(tmp_path, "sgd", 2):
        for a, b in zip(r["local"], r["dense"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_resume_mid_round_is_exact(tmp_path):
    run_ranks("tests.local_steps_cases:resume", world_size=2, out_dir=tmp_path, timeout=400)
    for r in load_rank_files(tmp_path, "resume", 2):
        for name, run in r.items():
            assert all(torch.equal(a, b) for a, b in zip(run["straight"], run["resumed"])), name
            assert all(torch.equal(a, b) for a, b in zip(run["anchor"], run["anchor_resumed"])), name


def test_rounds_start_from_rank_0s_weights_at_the_first_local_step(tmp_path):
    run_ranks("tests.local_steps_cases:warm_starts", world_size=2, out_dir=tmp_path, timeout=400)
    ranks = load_rank_files(tmp_path, "warm", 2)
    rounds = [r["no_optimizer_states"] for r in ranks]
    assert len(rounds[0]) >= 2
    for a, b in zip(*rounds):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    longer = [r["longer_warmup"] for r in ranks]  # dense steps after a resume into a longer warm-up
    assert all(torch.equal(x, y) for x, y in zip(*longer))
    for r in ranks:  # trained from the weights set by hand (0.5), not from the initial ones
        after, init = r["by_hand"]["after"], r["by_hand"]["init"]
        moved = max(float((w - 0.5).abs().max()) for w in after)
        assert moved < 0.1 < min(float((w - 0.5).abs().max()) for w in init)


def test_unsupported_set_ups_are_refused_by_name(tmp_path):
    run_ranks("tests.local_steps_cases:refusals", world_size=2, out_dir=tmp_path, timeout=300)
    for r in load_rank_files(tmp_path, "refusals", 2):
        assert "ZeRO stage 1" in r["zero1"] and "'dragonn.sync': 'local_steps'" in r["zero1"]
        assert "ZeRO stage 2" in r["zero2"]


def test_no_collective_between_syncs(tmp_path):
    """DeepSpeed clips by the ranks' common norm (an allreduce per step) and checks bf16/fp16 overflow over
    every rank: between syncs each rank clips and checks its own, so a local step issues no collective; the
    warm-up and the sync steps do (the counter counts)."""
    run_ranks("tests.local_steps_cases:collectives_per_step", world_size=2, out_dir=tmp_path, timeout=300)
    ranks = load_rank_files(tmp_path, "collectives", 2)
    for r in ranks:
        for name, run in r.items():
            steps = run["per_step"]  # steps 1-2 warm-up, 3 starts the rounds, 3-4 local, 5 sync, 6-7 local, 8 sync
            assert steps[0] > 0 and steps[1] > 0, (name, steps)
            assert steps[2] == 1, (name, steps)  # θ_outer from rank 0's weights: one allreduce, once
            assert steps[3] == steps[5] == steps[6] == 0, (name, steps)
            assert steps[4] > 0 and steps[7] > 0, (name, steps)
    for name in ranks[0]:  # a sync step still ends with bit-identical weights
        assert all(torch.equal(a, b) for a, b in zip(ranks[0][name]["weights"], ranks[1][name]["weights"]))


@pytest.mark.parametrize("world", [1, 3])
def test_a_checkpoint_of_another_world_size_restarts_every_rank_from_theta_outer(tmp_path, world):
    """Saved mid-round by 2 ranks, loaded by 1 or 3: every rank holds the saved θ_outer (not rank 0's
    mid-round local weights), the round count is kept, the warning names what was reset, and the next sync
    leaves θ_outer bit-identical on every rank."""
    run_ranks("tests.local_steps_cases:save_mid_round", world_size=2, out_dir=tmp_path, timeout=300)
    saved = load_rank_files(tmp_path, "saved", 2)
    run_ranks("tests.local_steps_cases:load_other_world", world_size=world, out_dir=tmp_path, timeout=300)
    runs = load_rank_files(tmp_path, f"world{world}", world)
    assert not all(torch.equal(a, b) for a, b in zip(saved[0]["weights"], [x.view_as(w) for x, w in
                                                                           zip(saved[0]["anchor"], saved[0]["weights"])]))
    for r, run in enumerate(runs):
        for got, anchor in zip(run["loaded"], saved[0]["anchor"]):
            assert torch.equal(got, anchor.view_as(got)), r
        assert run["rounds"] == saved[0]["rounds"] == 1
        text = " ".join(run["notes"])
        assert "θ_outer" in text and f"world size {world}" in text and "residuals" in text, text
        assert "next outer step comes at step 8" in text, text
        # this run's "auto" (√(workers), at least 2 at the cases' density 0.1), not the saved run's
        assert f"outer_lr auto: {max(2.0, math.sqrt(world)):.4g}" in text, text
        assert run["rounds_after"] == 2
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(run["after"], runs[0]["after"]))


def test_a_resume_that_goes_dense_loses_nothing_it_kept(tmp_path):
    """Saved with the unsent Δ in the weights, resumed at density 1.0: the dense round sends each rank's residual
    once: θ_outer = the mean of the ranks' weights, residual 0."""
    run_ranks("tests.local_steps_cases:switch_residual", world_size=2, out_dir=tmp_path, timeout=400)
    ranks = load_rank_files(tmp_path, "switch", 2)
    mean = sum(r["dense"]["before"] for r in ranks) / len(ranks)
    for r in ranks:
        assert not torch.equal(r["dense"]["before"], ranks[0]["dense"]["anchor_before"].to(r["dense"]["before"]))
        torch.testing.assert_close(r["dense"]["anchor"], mean, rtol=1e-6, atol=1e-6)
        assert float(r["dense"]["residual"].abs().max()) == 0.0
