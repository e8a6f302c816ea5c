"""The memory budget pinned: every persistent tensor ds_dragonn keeps per compressed bucket, counted, against
the stated table (``launch.bench.memory_budget.budget``; docs/design.md, "Memory budget per bucket").

The engine cases train a 19 k-parameter MLP for 4 steps (2 dense warm-up steps, then compressed) on 2 ranks
(flat) and 2 x 2 ranks (node-aware), at ZeRO 0-3, bf16 and fp32, the gradient and momentum modes, and count
the storages reachable from the hook (``launch/bench_memory.py --measure exact``). A component that grows past
its budget, or a new persistent store of the bucket's size, fails here.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from launch.bench.memory_budget import budget, component_of, deepspeed_storages, persistent_tensors
from ds_dragonn.decode import SparseDecoder
from ds_dragonn.feedback import ErrorFeedback
from ds_dragonn.momentum import LocalMomentum

REPO = Path(__file__).resolve().parents[1]
DENSITY = 0.01  # the engine cases' density (the package default)
PADDING = 1.002  # ZeRO 1-3 pad their buckets to aligned lengths
WIRES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _other_bound(world: int) -> float:
    """O(k) bookkeeping (the decode's touched positions, step counters): int64 positions of every rank's k."""
    return 8 * DENSITY * world + 0.05


class _Holder:
    """Stands in for a hook: a ds_dragonn-module object holding the stores (the walker follows only those)."""


_Holder.__module__ = "ds_dragonn.tests_holder"


def _hold(**stores):
    h = _Holder()
    h.__dict__.update(stores)
    return h


def _by_component(hook, exclude=frozenset()) -> dict:
    out = {}
    for path, (nbytes, _) in persistent_tensors(hook, exclude).items():
        out[component_of(path)] = out.get(component_of(path), 0) + nbytes
    return out


@pytest.mark.parametrize("numel", [0, 1, 1000, 4097])
@pytest.mark.parametrize("transactional", [False, True])
@pytest.mark.parametrize("wire", [torch.bfloat16, torch.float32, torch.float16])
def test_stores_hold_to_budget(numel, transactional, wire):
    """The stores themselves, one bucket through two steps: exactly the budget's residual and momentum bytes
    (and their working copies only when transactional), a decode buffer of the wire dtype (+ float32 for fp16)."""
    ef, mom, dec = ErrorFeedback(True, transactional), LocalMomentum(0.9, transactional), SparseDecoder()
    grad = torch.randn(numel).to(wire)
    for _ in range(2):
        tensors, scale = mom.update("b", [grad], wire)
        buf = ef.compensate_("b", tensors, wire, scale)
        k = min(numel, max(1, numel // 100))
        idx = torch.topk(buf.abs(), k).indices if numel else torch.zeros(0, dtype=torch.long)
        sent = buf[idx].to(wire)
        ef.commit("b", idx, buf[idx].clone(), sent)
        dec.decode("b", numel, [idx, idx], [sent, sent], wire, torch.device("cpu"), 0.5)
        ef.end_step(True)
        mom.end_step(True)
    got = _by_component(_hold(error_feedback=ef, momentum=mom, decoder=dec))
    want = budget("momentum", wire, transactional, stage=1, world=1, decode_into=False)  # (decode() keeps one)
    if numel == 0:
        assert sum(v for c, v in got.items() if c != "other") == 0
        return
    for comp, bpp in want.items():
        assert got.get(comp, 0) == bpp * numel, (comp, got)
    assert set(got) - {"other"} == set(want)
    assert got.get("other", 0) <= 16 * max(1, numel // 100)  # the decode's touched positions: O(k)


def test_walker_counts_each_storage_once_and_skips_deepspeed():
    """Views of one buffer count once; storages the engine owns (parameters, gradients) are not counted."""
    buf = torch.zeros(100)
    param = torch.nn.Parameter(torch.zeros(50))
    hook = _hold(a=buf, views=[buf[:10], buf[10:]], nested={"x": (buf,)}, param_view=param.data[5:])
    engine = _hold(module=torch.nn.Linear(1, 1))
    engine.module.weight = param
    counted = persistent_tensors(hook, deepspeed_storages(engine))
    assert [n for n, _ in counted.values()] == [400]
    assert component_of("hook._pipelines[1].error_feedback.undo._work['b']") == "residual working copy"
    assert component_of("hook.variance_freeze.params[0]") == "other"  # (DeepSpeed's: excluded by the walker)


def _engine_rows(layout: str, stages, dtypes, tmp_path) -> list:
    sys.path.insert(0, str(REPO))
    from launch.bench_memory import cases, launch
    world = 4 if layout == "node" else 2
    results = launch(cases(stages, dtypes, [layout], ("gradient", "momentum")), (64, 256, 10), 4, 2, world, 2,
                     tmp_path, False, 600)
    return results, world


@pytest.mark.parametrize("layout", ["flat", "node"])
def test_engine_buckets_hold_to_budget(layout, tmp_path):
    """Every (stage, dtype, mode) of the layout: each component at most its budget, nothing unbudgeted beyond
    O(k), and the residual present (the count is not vacuous)."""
    stages, dtypes = ([0, 1, 2, 3], ["bf16", "fp32"]) if layout == "flat" else ([0, 2], ["bf16", "fp32"])
    results, world = _engine_rows(layout, stages, dtypes, tmp_path)
    assert len(results) == len(stages) * len(dtypes) * 2
    for r in results:
        assert "error" not in r, r
        n = r["params"]
        got = {}
        for path, nbytes in r["parts"].items():
            got[component_of(path)] = got.get(component_of(path), 0) + nbytes / n
        want = budget(r["mode"], WIRES[r["dtype"]], r["transactional"], stage=r["stage"], world=world,
                      per_node=2 if layout == "node" else 1)
        where = f"{layout} ZeRO {r['stage']} {r['dtype']} {r['mode']}: {got}"
        assert not r["transactional"], where  # bf16, fp32: a skipped step returns what it sent (O(k)), no copies
        assert got.get("residual", 0) == pytest.approx(want["residual"]), where
        for comp, bpp in got.items():
            if comp == "other":
                assert bpp <= _other_bound(world), where
            else:
                assert comp in want and bpp <= want[comp] * PADDING + 1e-9, where
