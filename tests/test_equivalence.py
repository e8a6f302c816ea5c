"""DRAGONN at density 1.0 against the dense DeepSpeed engine, on the edge cases of the training loop.

One launch per world size (2 ranks and 1 rank over gloo, shared with other files' cases: tests/multiproc.py)
trains every case of ``tests/equivalence_cases.py`` with the dense engine (no "dragonn" block), with DRAGONN at
density 1.0 and at density 0.01 (policy "always", min_compress_numel 1): gradient accumulation 2 and 3, gradient
clipping 1.0 (with gradients ~30x the clip), a frozen hidden layer, a Linear with 0 outputs plus a Parameter of
shape (0,), at ZeRO stage 0, and the same accumulation/clip/frozen/empty cases at ZeRO stages 1 and 2.

* density 1.0 keeps every element and sums 2 addends (order-free), so the parameters must equal the dense
  engine's bit for bit (``torch.equal``) after every run, and every reduction must have gone through the
  compressed path (else the comparison would prove nothing);
* density 0.01 cannot match dense; its ranks must end bit-identical to each other with finite parameters.
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.equivalence_cases import CASES, OPT_STEPS, run_name
from tests.multiproc import ranks_fixture

WORLD_SIZES = [2, 1]
#: (world size, [rank 0 results, rank 1 results, ...])
runs = ranks_fixture("tests.equivalence_cases:equivalence_runs", "equiv", timeout=240, worlds=WORLD_SIZES,
                     ids=[str(w) for w in WORLD_SIZES], pool="gloo")


def _differing(a: dict, b: dict) -> list:
    """Names of the parameters that are not bit-identical (or not present in both)."""
    assert list(a) == list(b), (list(a), list(b))
    return [n for n in a if not (a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]))]


def _check_compressed(res: dict, case: dict):
    t = res["telemetry"]
    assert res["hooked"] and t is not None
    assert t["dense_reductions"] == 0, t
    if case.get("zero"):  # several buckets per step; stage 2 also reduces at every micro step
        assert t["compressed_reductions"] >= OPT_STEPS, t
    else:
        assert t["compressed_reductions"] == OPT_STEPS, t


@pytest.mark.parametrize("case", list(CASES))
def test_density_one_is_bit_identical_to_dense_engine(runs, case):
    world, results = runs
    assert results[0]["world"] == world
    for r, res in enumerate(results):
        dense, d1 = res[run_name(case, "dense")], res[run_name(case, "d1")]
        assert dense["telemetry"] is None and not dense["hooked"]
        _check_compressed(d1, CASES[case])
        assert dense["global_steps"] == d1["global_steps"] == OPT_STEPS
        assert _differing(dense["params"], d1["params"]) == [], f"rank {r}: {case} at density 1.0 differs from dense"
        # and the training moved the (trainable) parameters: the comparison is not between two initial models
        assert _differing(dense["initial"], dense["params"]) != []


@pytest.mark.parametrize("case", list(CASES))
def test_low_density_ranks_agree_and_stay_finite(runs, case):
    world, results = runs
    for res in results:
        _check_compressed(res[run_name(case, "d001")], CASES[case])
        assert all(bool(torch.isfinite(p).all()) for p in res[run_name(case, "d001")]["params"].values())
    for r in range(1, world):
        assert _differing(results[0][run_name(case, "d001")]["params"], results[r][run_name(case, "d001")]["params"]) \
            == [], f"rank {r} disagrees with rank 0 at density 0.01 ({case})"
    if world > 1:  # compression really changed the update (else the density was not applied)
        assert _differing(results[0][run_name(case, "dense")]["params"], results[0][run_name(case, "d001")]["params"])


def _norms(res: dict, case: dict) -> list:
    """The pre-clip global gradient norm of each optimizer step (ZeRO 1/2: the optimizer's own)."""
    return res["engine_grad_norms"] if case.get("zero") else res["grad_norms"]


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c].get("clip")])
def test_clipping_really_clips(runs, case):
    """The averaged gradient norm is far above the clip at every step, the density-1.0 run saw the same
    norms, and the same run without clipping ends elsewhere (so the clip acted)."""
    clip = CASES[case]["clip"]
    for res in runs[1]:
        dense, d1 = res[run_name(case, "dense")], res[run_name(case, "d1")]
        norms = _norms(dense, CASES[case])
        assert len(norms) == OPT_STEPS and all(n is not None and n > 5 * clip for n in norms), norms
        assert _norms(d1, CASES[case]) == norms
        assert all(math.isfinite(n) for n in _norms(res[run_name(case, "d001")], CASES[case]))
        if not CASES[case].get("zero"):
            assert _differing(dense["params"], res[run_name("noclip", "dense")]["params"])


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c].get("model") == "frozen"])
@pytest.mark.parametrize("variant", ["dense", "d1", "d001"])
def test_frozen_layer_stays_as_initialised(runs, case, variant):
    for res in runs[1]:
        run = res[run_name(case, variant)]
        assert run["frozen"] == ["mid.bias", "mid.weight"]
        for name in run["frozen"]:
            assert torch.equal(run["params"][name], run["initial"][name]), name


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c].get("model") == "empty"])
@pytest.mark.parametrize("variant", ["dense", "d1", "d001"])
def test_empty_parameters_had_empty_gradients(runs, case, variant):
    """The empty parameters were in the graph (their gradients exist, with 0 elements) at every step."""
    for res in runs[1]:
        run = res[run_name(case, variant)]
        assert run["empty_grads"] == [[(0, 64), (0,), (0,)]] * OPT_STEPS
        assert [tuple(run["params"][n].shape) for n in ("none_out.weight", "none_out.bias", "empty_vec")] == \
            [(0, 64), (0,), (0,)]


def test_accumulation_counts_optimizer_steps(runs):
    """gas 2 and 3 ran 2x and 3x the micro steps for the same number of optimizer steps, and differ."""
    res = runs[1][0]
    for variant in ("dense", "d1"):
        assert res[run_name("gas2", variant)]["global_steps"] == res[run_name("gas3", variant)]["global_steps"] \
            == OPT_STEPS
    assert _differing(res[run_name("gas2", "dense")]["params"], res[run_name("gas3", "dense")]["params"])
