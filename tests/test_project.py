"""The cost model (``launch/bench/project.py``): its α-β formulas against hand-computed cases, its bytes against the
wire format and the testbed's link counters, monotonicity, the GPU benchmark input, and the command line's
refusals. Fast: no processes."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from launch.bench import project as pj
from ds_dragonn.compress.base import target_k
from ds_dragonn.exchange.allgather import AllgatherExchange
from ds_dragonn.exchange.quantize import PLAIN
from ds_dragonn.exchange.wire import pair_block_bytes

FAST = pj.Link(1e9, 0.0)  # an intra-node link that costs nothing measurable


def _pred(c, w, mode):
    return pj.predict(c, w, [mode])[0]


def _w(n, **kw):
    return pj.Workload(n, 0.0, **kw)


def test_link_seconds_is_rounds_times_latency_plus_bytes_over_bandwidth():
    assert pj.Link(8.0, 10.0).seconds(3, 1e6) == pytest.approx(3 * 10e-6 + 1e6 * 8 / 8e9)


def test_flat_ring_allreduce_inside_one_node_is_2_p_minus_1_over_p_n_b():
    n, P = 1_000_000, 4
    c = pj.Cluster(1, P, pj.Link(8.0, 5.0), pj.Link(1.0, 1.0))
    for mode, b in (("dense_fp32", 4), ("dense_bf16", 2)):
        p = _pred(c, _w(n), mode)
        assert p.comm_ms == pytest.approx((2 * (P - 1) * 5e-6 + 2 * (P - 1) / P * n * b * 8 / 8e9) * 1e3)
        assert p.inter_mb == 0


def test_flat_ring_across_nodes_puts_one_ring_edge_on_each_node_link():
    n, N, L = 1_000_000, 2, 2
    c = pj.Cluster(N, L, FAST, pj.Link(1.0, 100.0))
    p = _pred(c, _w(n), "dense_fp32")
    edge = 2 * 3 / 4 * n * 4  # 2(P-1)/P n b, P = 4
    assert p.inter_mb == pytest.approx(edge / 1e6)
    assert p.comm_ms == pytest.approx((6 * 100e-6 + edge * 8 / 1e9) * 1e3)


def test_hierarchical_bf16_by_hand():
    """2 x 2, n = 1e6: reduce-scatter in the node (fast), two concurrent 2-rank rings across, each edge
    2(N-1)/N × n/L × 2 bytes = 1e6 B, so 2e6 B on the node's link; allgather in the node (fast)."""
    c = pj.Cluster(2, 2, FAST, pj.Link(1.0, 0.0))
    p = _pred(c, _w(1_000_000), "hier_bf16")
    assert p.inter_mb == pytest.approx(2.0)
    assert p.comm_ms == pytest.approx(2e6 * 8 / 1e9 * 1e3, rel=1e-6)


def test_allgather_exchange_bytes_are_the_exchanges_own_byte_model():
    """Inside one node the ring edge of the allgather exchange is what AllgatherExchange.max_bytes says a
    rank sends for k pairs (allgather.py): header and padded, packed pairs to every other rank."""
    n, P = 3_000_000, 4
    for wire in ("fp32", "bf16"):
        c = pj.Cluster(1, P, pj.Link(8.0, 0.0), pj.Link(1.0, 0.0))
        p = _pred(c, _w(n, wire=wire), "dragonn_flat")
        sent = AllgatherExchange(None).max_bytes(n, target_k(n, 0.01), pj.wire_dtype(wire), P)
        assert p.comm_ms * 1e-3 * 1e9 == pytest.approx(sent)


@pytest.mark.parametrize("N, L", [(2, 2), (4, 8), (16, 8)])
def test_node_aware_sparse_reduce_scatter_sends_1_over_L_of_flat_across_nodes(N, L):
    """Phase 1 of the partitioned exchange: flat, a node's L ranks send (N-1)/N of k pairs each across; node-aware,
    one shard of k/L per rank: 1/L of the pairs. In bytes a little less (each flat block carries the per-chunk
    counts of the whole bucket's packed positions, a shard's block those of the shard: wire.chunk_counts_bytes)."""
    n = 100_000_000
    c = pj.Cluster(N, L, FAST, pj.Link(1.0, 0.0))
    k, shard = target_k(n, 0.01), -(-n // L)
    flat = pj._all_to_all(c, pj.Group(N, L), pair_block_bytes(-(-k // (N * L)), n, torch.int32, torch.bfloat16, PLAIN))
    node = pj._all_to_all(c, pj.Group(N, 1), pair_block_bytes(-(-target_k(shard, 0.01) // N), shard, torch.int32,
                                                              torch.bfloat16, PLAIN))
    assert node[1] / flat[1] <= 1 / L
    if N * L <= 32:  # at 128 ranks a flat block's chunk counts are ~20 % of its pairs: the ratio falls further
        assert node[1] / flat[1] >= 0.9 / L


@pytest.mark.parametrize("N, L", [(2, 2), (4, 8), (16, 8)])
def test_node_aware_bytes_across_nodes_against_flat_follow_the_ring(N, L):
    """In a ring only one edge leaves a node, so the allgather exchange's cross-node bytes fall to (N-1)/(P-1)
    (about 1/L, not 1/L²: the L² of the issue counts what the node's ranks receive, forwarding included); the
    partitioned exchange's to 2(N-1)/N over L(N-1)/N + (P-1)/P (its owners' allgather is one ring edge too)."""
    n, P = 100_000_000, N * L
    c = pj.Cluster(N, L, FAST, pj.Link(1.0, 0.0))
    by = {p.mode: p.inter_mb for p in pj.predict(c, _w(n, wire="bf16"))}
    assert by["dragonn_node"] / by["dragonn_flat"] == pytest.approx((N - 1) / (P - 1), rel=0.02)
    part = 2 * (N - 1) / N / (L * (N - 1) / N + (P - 1) / P)
    assert by["part_node"] / by["part_flat"] <= part * 1.05
    if P <= 32:  # (at 128 ranks the flat blocks' chunk counts weigh: the ratio is lower, above)
        assert by["part_node"] / by["part_flat"] == pytest.approx(part, rel=0.05)
    assert by["part_node"] <= by["part_flat"] and by["dragonn_node"] <= by["dragonn_flat"] / L * 1.05


def test_model_reproduces_the_testbeds_link_counters():
    """2 x 2 testbed (docs/results/nodes/nodes_all_modes.json): predicted bytes of the dense modes within 2 % of the
    veth's counters, and the node-aware / flat ratios within 15 % of the counters' (TCP headers and
    acknowledgements, and the largest of the ranks' counts padding every list, are not modelled)."""
    rows = {(r["testbed"], r["link"], r["mode"]): r for r in pj.validate()}
    for mode in ("dense_fp32", "dense_bf16"):
        r = rows["2x2", "100mbit", mode]
        assert r["predicted_mb"] == pytest.approx(r["measured_mb"], rel=0.02)
    for node, flat in (("dragonn_node", "dragonn_flat"), ("part_node", "part_flat")):
        pred = rows["2x2", "100mbit", node]["predicted_mb"] / rows["2x2", "100mbit", flat]["predicted_mb"]
        meas = rows["2x2", "100mbit", node]["measured_mb"] / rows["2x2", "100mbit", flat]["measured_mb"]
        assert pred == pytest.approx(meas, rel=0.15)


def test_validation_of_the_bandwidth_bound_modes_is_within_15_percent():
    """What the model is for: dense steps on the slow links (100 Mbit/s 2 x 2, 1 Gbit/s 2 x 1) and DRAGONN on
    the 24 M-parameter 2 x 1 testbed at 1 Gbit/s. (The latency-bound DRAGONN steps of the 167 k-parameter 2 x 2
    testbed are not: docs/projection.md says why.) Each link's compute is its own no-exchange step; where that
    is negative (1 Gbit/s in the earlier nodes.json), the first positive one's."""
    rows = {(r["testbed"], r["link"], r["mode"]): r for r in pj.validate()}
    for key in (("2x2", "100mbit", "dense_fp32"), ("2x2", "100mbit", "dense_bf16"), ("2x2", "100mbit", "hier_bf16"),
                ("2x1", "1gbit", "dense_fp32"), ("2x1", "1gbit", "dense_bf16"), ("2x1", "1gbit", "dragonn_flat")):
        assert abs(rows[key]["error_pct"]) <= 15, (key, rows[key])
    assert rows["2x2", "1gbit", "dense_fp32"]["compute_from"] == "1gbit"
    earlier = {(r["testbed"], r["link"], r["mode"]): r
               for r in pj.validate(nodes_json="docs/results/nodes/nodes.json")}
    assert earlier["2x2", "1gbit", "dense_fp32"]["compute_from"] == "100mbit"  # its own no-exchange step is negative


def test_monotone_in_bandwidth_size_density_and_overlap():
    base = pj.Cluster(4, 8, pj.Link(7200.0, 3.0), pj.Link(10.0, 10.0))
    w = pj.Workload(100_000_000, 100.0, wire="bf16")
    for mode in pj.MODES:
        steps = [_pred(pj.Cluster(4, 8, base.intra, pj.Link(g, 10.0)), w, mode).step_ms for g in (1, 10, 100)]
        assert steps[0] >= steps[1] >= steps[2], mode
        sizes = [_pred(base, pj.Workload(n, 100.0, wire="bf16"), mode).step_ms for n in (10**6, 10**7, 10**8)]
        assert sizes[0] < sizes[1] < sizes[2], mode
        hidden = [_pred(base, pj.Workload(10**8, 100.0, overlap=o), mode) for o in (0.0, 0.5, 1.0)]
        assert hidden[0].step_ms > hidden[1].step_ms >= hidden[2].step_ms >= 100.0, mode
        for p, o in zip(hidden, (0.0, 0.5, 1.0)):  # communication hides behind at most overlap x compute
            assert p.step_ms == pytest.approx(100.0 + p.local_ms + max(0.0, p.comm_ms - o * 100.0)), (mode, o)
    for mode in ("dragonn_flat", "part_flat", "dragonn_node", "part_node"):
        by_density = [_pred(base, pj.Workload(10**8, 100.0, density=d), mode).inter_mb for d in (0.001, 0.01, 0.1)]
        assert by_density[0] < by_density[1] < by_density[2], mode


def test_one_node_sends_nothing_across_and_one_rank_per_node_has_no_node_collectives():
    w = _w(10**7)
    for p in pj.predict(pj.Cluster(1, 8, pj.Link(100.0, 1.0), pj.Link(1.0, 1.0)), w):
        assert p.inter_mb == 0, p
    none = _pred(pj.Cluster(4, 1, pj.Link(100.0, 1.0), pj.Link(1.0, 1.0)), pj.Workload(10**7, 50.0), "none")
    assert none.step_ms == 50.0 and none.comm_ms == 0


def test_gpu_local_rate_reads_a_phases_benchmark_else_says_it_assumes(tmp_path):
    rate, overhead, source = pj.gpu_local_rate(tmp_path)
    assert (rate, overhead) == (pj.GPU_LOCAL_RATE, pj.GPU_LOCAL_OVERHEAD) and "ASSUMED" in source
    records = [{"device": "cuda", "dtype": "float32", "numel": 2**24, "total_ms": 2.0},
               {"device": "cuda", "dtype": "float32", "numel": 2**20, "total_ms": 1.0},
               {"device": "cpu", "dtype": "float32", "numel": 2**26, "total_ms": 50.0}]
    (tmp_path / "run1").mkdir()
    (tmp_path / "run1" / "phases_gpu.json").write_text(json.dumps({"records": records}))
    rate, overhead, source = pj.gpu_local_rate(tmp_path)
    assert rate == pytest.approx(2**24 / 2.0 * 1e3) and overhead == 0.0 and "measured" in source


@pytest.mark.parametrize("argv, flag", [(["--nodes", "0"], "--nodes"), (["--inter-gbit", "-5"], "--inter-gbit"),
                                        (["--intra-gbit", "0"], "--intra-gbit"), (["--density", "2"], "--density"),
                                        (["--overlap", "1.5"], "--overlap"), (["--ranks-per-node", "2.5"],
                                                                              "--ranks-per-node"),
                                        (["--compute-ms", "nan"], "--compute-ms"), (["--params", "abc"], "--params")])
def test_bad_input_is_an_argparse_error_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        pj.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}:" in err, err


def test_main_prints_a_table_per_bandwidth_and_writes_json(tmp_path, capsys):
    out = tmp_path / "p.json"
    result = pj.main(["--params", "1.3e9", "--inter-gbit", "25", "100", "--exchange", "partitioned", "--json", str(out)])
    text = capsys.readouterr().out
    assert "ASSUMED" in text and "inter-node 25 Gbit/s" in text and "inter-node 100 Gbit/s" in text
    saved = json.loads(out.read_text())
    assert saved["tables"].keys() == {"25", "100"} == result["tables"].keys()
    modes = [r["mode"] for r in saved["tables"]["25"]]
    assert "part_node" in modes and "dragonn_node" not in modes
    bf16 = next(r for r in saved["tables"]["25"] if r["mode"] == "dense_bf16")
    assert bf16["speedup_vs_dense_bf16"] == 1.0
    fast = {r["mode"]: r["step_ms"] for r in saved["tables"]["100"]}
    slow = {r["mode"]: r["step_ms"] for r in saved["tables"]["25"]}
    assert all(fast[m] <= slow[m] for m in fast)


def test_validate_takes_a_bench_nodes_record_in_place_of_the_committed_one(tmp_path, capsys):
    """``--validate PATH``: the 2 x 2 rows come from PATH (here a copy of the 100 Mbit/s record with doubled steps),
    the 2 x 1 ones stay."""
    data = json.loads((pj.REPO / pj.TESTBEDS["2x2"][0][0]).read_text())
    for r in data["rows"]:
        r["ms_per_step"] *= 2
    path = tmp_path / "nodes.json"
    path.write_text(json.dumps(data))
    base = {(r["testbed"], r["link"], r["mode"]): r for r in pj.main(["--validate"])["validation"]}
    new = {(r["testbed"], r["link"], r["mode"]): r for r in pj.main(["--validate", str(path)])["validation"]}
    assert "dense_bf16" in capsys.readouterr().out
    key = ("2x2", "100mbit", "dense_bf16")
    assert new[key]["measured_ms"] == pytest.approx(2 * base[key]["measured_ms"])
    assert new[key]["predicted_ms"] > base[key]["predicted_ms"]  # the compute input doubled with the none step
    assert new["2x1", "1gbit", "dense_fp32"] == base["2x1", "1gbit", "dense_fp32"]
    assert ("2x2", "1gbit", "dense_fp32") in base and ("2x2", "1gbit", "dense_fp32") not in new  # PATH replaces both


def test_one_rank_per_node_shows_no_node_aware_rows(capsys):
    """At L = 1 the node-aware modes and hier_bf16 are the flat ones and dense_bf16 (``hierarchy`` resolves to
    flat): the table leaves them out and says so."""
    result = pj.main(["--nodes", "4", "--ranks-per-node", "1", "--inter-gbit", "25"])
    modes = [r["mode"] for r in result["tables"]["25"]]
    assert not set(pj.NODE_MODES) & set(modes) and "dragonn_flat" in modes and "part_flat" in modes
    assert "1 rank per node" in capsys.readouterr().out
    full = [r["mode"] for r in pj.main(["--nodes", "4", "--ranks-per-node", "2", "--inter-gbit", "25"])["tables"]["25"]]
    assert set(pj.NODE_MODES) <= set(full)


def test_the_module_needs_no_torch_for_help():
    """project.py imports torch and the wire format where the model runs, so its --help needs neither."""
    code = ("import sys\nsys.path.insert(0, sys.argv[1])\n"
            "import project as pj\n"
            "try:\n    pj.parse_args(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
            "assert 'torch' not in sys.modules and 'ds_dragonn' not in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code, str(pj.REPO / "launch" / "bench")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "--ranks-per-node" in proc.stdout, proc.stdout + proc.stderr
