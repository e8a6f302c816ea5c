"""DRAGONN state in DeepSpeed's checkpoints: exact resume, and the documented rule for each mismatch.

One launch of 2 ranks trains 2K steps saving at K (``engine.save_checkpoint``, nothing else); a second
launch, in fresh processes, loads each checkpoint (``engine.load_checkpoint``) and trains to 2K; a third
loads a 2-rank checkpoint on 3 ranks.
"""
from __future__ import annotations

import pytest
import torch

from tests.ckpt_cases import RELOAD_IN_PROCESS, RESUME_RUNS
from tests.multiproc import run_ranks


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt")
    run_ranks("tests.ckpt_cases:save_runs", 2, out, timeout=400)
    run_ranks("tests.ckpt_cases:resume_runs", 2, out, timeout=400)
    run_ranks("tests.ckpt_cases:resized_runs", 3, out, timeout=400)
    load = lambda stem, n: [torch.load(out / f"{stem}_rank{r}.pt", weights_only=False) for r in range(n)]  # noqa: E731
    return {"dir": out, "save": load("save", 2), "resume": load("resume", 2), "resized": load("resized", 3)}


def _equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", list(RESUME_RUNS))
def test_resume_equals_the_uninterrupted_run_bit_for_bit(ckpt, name):
    for r in range(2):
        saved, resumed = ckpt["save"][r][name], ckpt["resume"][r][name]
        assert resumed["loaded"] and resumed["global_steps"] == 3
        assert _equal(saved["params"], resumed["params"]), f"rank {r}: resumed run differs"
        if name != "s0_dense":
            assert resumed["notes"] == [], resumed["notes"]
            assert saved["mass_at_k"] > 0 and resumed["mass_after_load"] == pytest.approx(saved["mass_at_k"], rel=1e-12)


def test_every_rank_writes_its_own_file_beside_deepspeeds(ckpt):
    folder = ckpt["dir"] / "ckpt" / "s0_fp32" / "k"
    assert (folder / "mp_rank_00_model_states.pt").is_file()
    states = [torch.load(folder / f"dragonn_rank{r}.pt", weights_only=False) for r in range(2)]
    for r, st in enumerate(states):
        d = st["description"]
        assert (d["rank"], d["world_size"], d["global_steps"]) == (r, 2, 3)
        assert d["dragonn"]["density"] == 0.01 and d["parameters"][0] == ("0.weight", (64, 32))
        assert st["error_feedback"]["residuals"]
    # the residuals differ between ranks (each rank's own unsent gradient): one file per rank is needed
    a, b = (next(iter(s["error_feedback"]["residuals"].values())) for s in states)
    assert not torch.equal(a, b)
    part = torch.load(ckpt["dir"] / "ckpt" / "s0_partitioned" / "k" / "dragonn_rank1.pt", weights_only=False)
    assert part["exchange"][0]["server"]["residuals"], "the partitioned exchange's server residuals are saved"
    assert not (ckpt["dir"] / "ckpt" / "s0_dense" / "k" / "dragonn_rank0.pt").exists()


def test_density_change_keeps_residuals_with_a_warning(ckpt):
    for r in range(2):
        got = ckpt["resume"][r]["density_changed"]
        assert got["mass_after_load"] > 0
        assert len(got["notes"]) == 1 and "dragonn.density 0.01 (now 0.001)" in got["notes"][0]
        assert "kept" in got["notes"][0]


def test_exchange_change_folds_server_residuals_exactly(ckpt):
    for r in range(2):
        got = ckpt["resume"][r]["exchange_changed"]
        assert any("exchange partitioned (now allgather)" in n for n in got["notes"]), got["notes"]
        state = torch.load(ckpt["dir"] / "ckpt" / "s0_partitioned" / "k" / f"dragonn_rank{r}.pt", weights_only=False)
        worker = sum(float(v.double().abs().sum()) for v in state["error_feedback"]["residuals"].values())
        server = sum(float(v.double().abs().sum()) for v in state["exchange"][0]["server"]["residuals"].values())
        assert server > 0
        # the folded residual holds both (|a+b| <= |a|+|b|, and more than the worker part alone here)
        assert worker < got["mass_after_load"] <= worker + server + 1e-9


@pytest.mark.parametrize("name", list(RELOAD_IN_PROCESS))
def test_reloading_in_the_same_process_equals_the_uninterrupted_run(ckpt, name):
    """A load in the middle of a run (after more steps, an overflow step for bf16) starts a fresh round:
    bucket ordinals from 0 (the residual keys match), no open step transaction or undo log carried over."""
    for r in range(2):
        saved = ckpt["save"][r][name]
        assert _equal(saved["params"], saved["reloaded_params"]), f"rank {r}"
        assert saved["restored_steps"] == (1 if RELOAD_IN_PROCESS[name][1] >= 0 else 0)


def test_a_flush_owed_on_a_skipped_step_is_still_owed(ckpt):
    for r in range(2):
        f = ckpt["resume"][r]["flush_on_skipped_step"]  # exact_skipped_steps: the step transaction
        assert f["skipped"] == 1 and f["after_load"] > 0
        assert f["after_skipped"] == pytest.approx(f["after_load"], rel=1e-12)  # restored, still owed
        assert f["pending_after_skipped"] >= 1
        assert f["after_next"] < 0.01 * f["after_load"]  # flushed by the next (applied) dense step


def test_a_flush_on_a_skipped_step_returns_what_it_sent(ckpt):
    """bf16's default (no working copies): the flushed residual comes back on rank 1, whose gradient was finite
    (with that step's gradient added), and is reset on rank 0, whose gradient was all Inf/NaN; still owed
    either way, and flushed by the next applied step."""
    for r in range(2):
        f = ckpt["resume"][r]["flush_on_skipped_step_ok"]
        assert f["skipped"] == 1 and f["after_load"] > 0 and f["pending_after_skipped"] >= 1
        if r == 1:
            assert f["after_skipped"] > 0.5 * f["after_load"]  # returned, not lost
        else:
            assert f["after_skipped"] == 0.0
        assert f["after_next"] < 0.01 * max(f["after_load"], f["after_skipped"])


@pytest.mark.parametrize("case, words", [("model_changed", "trainable parameters 0.weight: (64, 32) (now absent)"),
                                         ("predivide_changed", "gradient_predivide_factor 1.0 (now 2.0)"),
                                         ("warm_start", "a warm start"),
                                         ("no_dragonn_state", "not found")])
def test_mismatches_reset_residuals_with_a_warning_naming_the_cause(ckpt, case, words):
    for r in range(2):
        got = ckpt["resume"][r][case]
        assert got["mass_after_load"] == 0.0
        assert len(got["notes"]) == 1 and words in got["notes"][0] and "start empty" in got["notes"][0], got["notes"]
        assert all(bool(torch.isfinite(p).all()) for p in got["params"])
    assert _equal(ckpt["resume"][0][case]["params"], ckpt["resume"][1][case]["params"])


def test_world_size_change_resets_on_every_rank(ckpt):
    runs = ckpt["resized"]
    for r, got in enumerate(runs):
        assert got["loaded"] and got["mass_after_load"] == 0.0 and len(got["notes"]) == 1
        assert ("world size 2 (now 3)" if r < 2 else "not found") in got["notes"][0], got["notes"]
    assert _equal(runs[0]["params"], runs[1]["params"]) and _equal(runs[0]["params"], runs[2]["params"])


def test_load_state_dict_refuses_what_is_not_a_state():
    from ds_dragonn.config import DragonnConfig
    from ds_dragonn.engine.base import HookBase
    from tests.fakes import fake_engine
    hook = HookBase(fake_engine(), DragonnConfig(enabled=True))
    with pytest.raises(ValueError, match="x.pt is not a valid DRAGONN state: no 'error_feedback'"):
        hook.load_state_dict({"model": 1}, source="x.pt")
    good = hook.state_dict()
    key = ("allreduce", 0, "torch.bfloat16", 6, "abc")  # a stage-0 key: 6 elements, bf16 wire -> fp32 residual
    for residual, words in ((torch.ones(2, 2), "not a 1-D float tensor"), (torch.ones(5), "5 elements for a bucket of 6"),
                            (torch.ones(6, dtype=torch.float64), "residual dtype is torch.float32"),
                            (torch.tensor([1.0, float("nan"), 0, 0, 0, 0]), "NaN or Inf")):
        with pytest.raises(ValueError, match=words):
            hook.load_state_dict(dict(good, error_feedback={"residuals": {key: residual}}))
    for part, value in (("error_feedback", 5), ("error_feedback", None), ("description", "hello"), ("exchange", 5),
                        ("pending", 5), ("telemetry", [1]), ("description", dict(good["description"], format="2")),
                        ("description", dict(good["description"], parameters=None))):
        with pytest.raises(ValueError, match="not a valid DRAGONN state"):
            hook.load_state_dict(dict(good, **{part: value}))
    newer = dict(good, description=dict(good["description"], format=99))
    with pytest.raises(ValueError, match="format 99"):
        hook.load_state_dict(newer)
    # bucketing differs: reset, naming it
    other = dict(good, description=dict(good["description"], bucketing={"zero_optimization.stage": 2}),
                 error_feedback={"enabled": True, "residuals": {"b": torch.ones(3)}})
    hook.load_state_dict(other, source="y.pt")
    assert hook.error_feedback.residuals == {} and "zero_optimization.stage 2 (now 0)" in hook.notes[-1]


@pytest.mark.parametrize("saved, now", [("momentum", "gradient"), ("gradient", "momentum")])
def test_a_compress_mode_switch_resets_the_residuals_naming_both_modes(saved, now):
    """Unsent momenta are not unsent gradients (reused, they moved the weights 12-42 learning rates at once):
    a state saved in the other ``compress`` mode starts empty, with a warning naming both modes; the same mode
    keeps its residuals."""
    from ds_dragonn.config import DragonnConfig
    from ds_dragonn.engine.base import HookBase
    from tests.fakes import fake_engine

    def hook(mode):
        p = torch.nn.Parameter(torch.ones(6))
        return HookBase(fake_engine(optimizer=torch.optim.AdamW([p], lr=0.1)),
                        DragonnConfig(enabled=True, compress=mode, warmup_steps=1))
    key = (0, "torch.float32", 6, "abc")
    source = hook(saved)
    source.error_feedback.residuals[key] = torch.ones(6)
    state = source.state_dict()
    target = hook(now)
    target.load_state_dict(state, source="z.pt")
    assert target.error_feedback.residuals == {} and not target.pending
    assert f"dragonn.compress {saved} (now {now})" in target.notes[-1] and "start empty" in target.notes[-1]
    same = hook(saved)
    same.load_state_dict(state, source="z.pt")
    assert [r.tolist() for r in same.error_feedback.residuals.values()] == [[1.0] * 6] and not same.notes


@pytest.mark.parametrize("saved, now, kind", [("allgather", "partitioned", "kept"),
                                              ("partitioned", "allgather", "fold")])
def test_an_exchange_switch_keeps_or_folds_the_residuals(saved, now, kind):
    """Another exchange holds the same units: the worker residuals are kept, and the partitioned exchange's
    server residuals are folded into them (engine/state.py)."""
    from ds_dragonn.config import DragonnConfig
    from ds_dragonn.engine.state import compare
    desc = {"world_size": 2, "rank": 0, "bucketing": {}, "parameters": []}
    dump = (lambda x: {**desc, "exchange": x, "dragonn": DragonnConfig(enabled=True, exchange=x).model_dump(mode="json")})
    reset, fold, kept = compare(dump(saved), dump(now))
    assert not reset
    assert (fold if kind == "fold" else kept) and f"partitioned" in " ".join(fold + kept)


def test_ranks_resuming_different_tags_fail_on_every_rank(ckpt):
    for r in range(2):
        msg = ckpt["resume"][r]["different_tags"]
        assert msg is not None and msg.startswith(f"[rank {r}]") and "rank 0: 3, rank 1: 6" in msg, msg
        msg = ckpt["resume"][r]["same_step_other_tag"]
        assert msg is not None and "tags at the same step" in msg, msg


def test_bucket_keys_are_read_by_field_and_malformed_keys_are_refused():
    from ds_dragonn.config import DragonnConfig
    from ds_dragonn.engine import BucketKey
    from ds_dragonn.engine.base import HookBase
    from tests.fakes import fake_engine
    key = BucketKey.parse(("zero", 3, "torch.bfloat16", 6, "abc"))
    assert key == BucketKey("zero", 3, "torch.bfloat16", 6, "abc") and key.numel == 6
    assert key.torch_dtype == torch.bfloat16 and BucketKey.parse(key) == key
    for not_a_key in ("b", (1, 2), (3, "torch.bfloat16", 6, "abc"), ("allreduce", "3", "torch.float32", 6, "x"),
                      ("other", 3, "torch.float32", 6, "x")):
        assert BucketKey.parse(not_a_key) is None
    hook = HookBase(fake_engine(), DragonnConfig(enabled=True))
    good = hook.state_dict()
    residual = torch.arange(6, dtype=torch.float32)
    hook.load_state_dict(dict(good, error_feedback={"enabled": True, "residuals": {key: residual}}, pending=[key]))
    assert list(hook.error_feedback.residuals) == [key] and type(next(iter(hook.error_feedback.residuals))) is BucketKey
    assert torch.equal(hook.error_feedback.residuals[key], residual) and hook.pending == {key}
    # the length check reads the key's field
    with pytest.raises(ValueError, match="5 elements for a bucket of 6"):
        hook.load_state_dict(dict(good, error_feedback={"residuals": {key: torch.ones(5)}}))
