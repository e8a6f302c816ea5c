"""An α-β cost model of one data-parallel training step on N nodes × L ranks: dense, hierarchical and DRAGONN.

A collective costs ``rounds × α + bytes × 8 / bandwidth`` on its slowest link. A ring over all ranks (nodes
contiguous) puts one ring edge on each node's inter-node link; L rings of one rank per node put L there; an
all-to-all is one round, with every block a node's ranks address to other nodes on its link. Bytes are the wire
format's (``ds_dragonn/exchange/wire.py``: packed (index, value) pairs at ``k = ceil(density × n)``, headers). Modes, named
as in ``launch/bench_nodes.py``: ``none`` (compute and the node's dense fp32 allreduce), ``dense_fp32``,
``dense_bf16`` (flat ring allreduce), ``hier_bf16`` (reduce-scatter in the node, allreduce across, allgather in
the node), ``dragonn_flat``/``part_flat`` (allgather/partitioned exchange among all ranks) and
``dragonn_node``/``part_node`` (``hierarchy.py``: fp32 allreduce in the node, select on the 1/L shard, exchange
among the N ranks of a local index, allgather in the node). Step = compute + local work + the communication
not hidden behind ``overlap`` × compute. docs/projection.md; ``--validate``: against the testbed. A benchmark
tool (``python launch/bench/project.py``), not part of the package: its constants are the test machine's.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, List, NamedTuple

if TYPE_CHECKING:
    import torch
# torch and the wire format (exchange/wire.py) are imported where the model runs: --help needs neither

REPO = Path(__file__).resolve().parents[2]
MODES = ("none", "dense_fp32", "dense_bf16", "hier_bf16", "dragonn_flat", "part_flat", "dragonn_node", "part_node")
WIRE = {"fp32": "float32", "bf16": "bfloat16"}  # --wire: the torch dtype's name
SCHEMES = {"allgather": ("dragonn_flat", "dragonn_node"), "partitioned": ("part_flat", "part_node")}
#: at 1 rank per node these are dense_bf16 and the flat modes (``hierarchy`` resolves to flat): not shown there
NODE_MODES = ("hier_bf16", "dragonn_node", "part_node")

# -- GPU assumptions, used until a GPU benchmark (launch/gpu_check.sh: phases_gpu.json) sits under docs/gpu/ --
GPU_LOCAL_RATE = 1e11     # elements/s of DRAGONN's local work: 8 fp32 passes (as on this CPU) at 3 TB/s of HBM
GPU_LOCAL_OVERHEAD = 0.5  # ms per step of that work regardless of size (kernel launches, a few host syncs)
GPU_DENSE_RATE = 2.5e11   # elements/s of DeepSpeed's dense local work (flatten, scale, copy back): 3 fp32 passes
# -- the testbed's host (2 cores, shared), measured: docs/results/projection/host.json ---------------------------------
TESTBED_ALPHA_US = 1330.0  # one message round, 4-rank gloo ring on loopback (launch/bench_gloo_latency.py, median)
TESTBED_HOST_GBIT = 8.0    # gloo/TCP loopback, 2-rank allreduce of 16 MB (same script, median): caps every link
CPU_LOCAL_OVERHEAD = 1.43  # ms; DRAGONN local work on 1 core = 1.43 ms + n / 6.1e8 (launch/bench_step.py fp32,
CPU_LOCAL_RATE = 6.1e8     # 1 thread: 1.70 ms at 167,178 elements, 41.1 ms at 24,202,250)
CPU_DENSE_RATE = 3.1e8     # elements/s, DeepSpeed's dense local work on 1 core (77.8 ms at 24.2 M, same run)


@dataclass(frozen=True)
class Link:
    """A link: ``gbit_s`` bandwidth (Gbit/s, each direction) and ``latency_us`` per message round (µs)."""
    gbit_s: float
    latency_us: float

    def seconds(self, rounds: int, nbytes: float) -> float:
        """Seconds for ``rounds`` message rounds carrying ``nbytes`` bytes in all over this link."""
        return rounds * self.latency_us * 1e-6 + nbytes * 8 / (self.gbit_s * 1e9)


@dataclass(frozen=True)
class Cluster:
    """``nodes`` × ``ranks_per_node`` ranks; ``intra`` links ranks of a node, ``inter`` is each node's link."""
    nodes: int
    ranks_per_node: int
    intra: Link
    inter: Link


@dataclass(frozen=True)
class Workload:
    """A step: ``params`` gradient elements (one bucket), ``compute_ms`` (forward, backward, optimizer), DRAGONN at
    ``density`` with ``wire`` values; local work ``local_overhead_ms`` + elements / ``local_rate`` (elements/s), dense
    local work elements / ``dense_rate``; ``overlap``: fraction of compute communication hides behind (0: none)."""
    params: int
    compute_ms: float
    density: float = 0.01
    wire: str = "fp32"
    local_rate: float = GPU_LOCAL_RATE
    local_overhead_ms: float = GPU_LOCAL_OVERHEAD
    dense_rate: float = GPU_DENSE_RATE
    overlap: float = 0.0


class Prediction(NamedTuple):
    """One mode's step: ms in all, of compute, local work and communication; inter-node MB one node sends."""
    mode: str
    step_ms: float
    compute_ms: float
    local_ms: float
    comm_ms: float
    inter_mb: float


#: ranks of one collective: ``nodes`` spanned, ``per_node`` ranks in each; L / per_node such groups run side by side
Group = NamedTuple("Group", [("nodes", int), ("per_node", int)])


def wire_dtype(name: str) -> "torch.dtype":
    """The torch dtype of a ``--wire`` name (``WIRE``)."""
    import torch
    return getattr(torch, WIRE[name])


def _ring(c: Cluster, g: Group, rounds: int, edge: float) -> tuple:
    """(seconds, inter-node bytes per node) of ``rounds`` ring rounds sending ``edge`` bytes per ring edge."""
    if g.nodes * g.per_node <= 1 or rounds == 0:
        return 0.0, 0.0
    if g.nodes == 1:
        return c.intra.seconds(rounds, edge), 0.0
    across = c.ranks_per_node // g.per_node * edge  # the node's rings share its link
    return max(c.inter.seconds(rounds, across), c.intra.seconds(rounds, edge) if g.per_node > 1 else 0.0), across


def _all_to_all(c: Cluster, g: Group, block: float) -> tuple:
    """(seconds, inter-node bytes per node) of an all-to-all of ``block`` bytes from each rank to each other."""
    inside = c.intra.seconds(1, (g.per_node - 1) * block) if g.per_node > 1 else 0.0
    if g.nodes == 1:
        return inside, 0.0
    across = c.ranks_per_node * (g.nodes - 1) * g.per_node * block
    return max(c.inter.seconds(1, across), inside), across


def _sum(parts) -> tuple:  # collectives one after another: (seconds, bytes) summed
    return tuple(map(sum, zip((0.0, 0.0), *parts)))


def exchange_cost(c: Cluster, g: Group, numel: int, density: float, wire: torch.dtype, scheme: str) -> tuple:
    """(seconds, inter-node bytes per node) of one DRAGONN exchange of a ``numel`` bucket among group ``g``."""
    from ds_dragonn.compress.base import index_dtype, target_k
    from ds_dragonn.exchange.allgather import HEADER_INTS
    from ds_dragonn.exchange.quantize import PLAIN
    from ds_dragonn.exchange.wire import align, counts_header_bytes, index_block_bytes, pair_block_bytes
    size, vb, idt = g.nodes * g.per_node, wire.itemsize, index_dtype(numel)  # size 1: every collective costs 0
    header, k = (size - 1) * HEADER_INTS * 8, target_k(numel, density)
    if scheme == "allgather":  # allgather.py: a header, then every rank's padded pairs to every rank
        payload = index_block_bytes(align(k), numel, idt) + align(k) * vb
        return _ring(c, g, 2 * (size - 1), header + (size - 1) * payload)
    # partitioned.py: counts header, all-to-all of pairs to owners, header, allgather of owners' pairs or bitmap
    part = -(-numel // size)
    owner = align(target_k(part, density))
    gathered = min(index_block_bytes(owner, numel, idt), align(-(-part // 8))) + owner * vb
    return _sum([_ring(c, g, size - 1, counts_header_bytes(size)),
                 _all_to_all(c, g, pair_block_bytes(-(-k // size), numel, idt, wire, PLAIN)),
                 _ring(c, g, 2 * (size - 1), header + (size - 1) * gathered)])


def predict(c: Cluster, w: Workload, modes=MODES) -> List[Prediction]:
    """The step of every mode in ``modes`` (see the module docstring) on cluster ``c`` for workload ``w``."""
    from ds_dragonn.exchange.wire import dense_allreduce_bytes, dense_reduce_scatter_bytes
    n, N, L = w.params, c.nodes, c.ranks_per_node
    flat, node, cross = Group(N, L), Group(1, L), Group(N, 1)
    wire, shard = wire_dtype(w.wire), -(-n // L)
    node_sum = _ring(c, node, 2 * (L - 1), dense_allreduce_bytes(shard * L, 4, L))  # fp32 (hierarchy.py)
    dense_local = n / w.dense_rate * 1e3

    def local(elements: float) -> float:
        return w.local_overhead_ms + elements / w.local_rate * 1e3
    comm = {"none": (node_sum, dense_local if L > 1 else 0.0),
            "dense_fp32": (_ring(c, flat, 2 * (N * L - 1), dense_allreduce_bytes(n, 4, N * L)), dense_local),
            "dense_bf16": (_ring(c, flat, 2 * (N * L - 1), dense_allreduce_bytes(n, 2, N * L)), dense_local),
            "hier_bf16": (_sum([_ring(c, node, L - 1, dense_reduce_scatter_bytes(shard * L, 2, L)),
                                _ring(c, cross, 2 * (N - 1), dense_allreduce_bytes(shard, 2, N)),
                                _ring(c, node, L - 1, (L - 1) * shard * 2)]), dense_local)}
    for scheme, (fl, nd) in SCHEMES.items():
        owner = scheme == "partitioned"  # the owners' pass over their part: n / P elements (partitioned.py)
        comm[fl] = (exchange_cost(c, flat, n, w.density, wire, scheme), local(n + owner * n / (N * L)))
        comm[nd] = (_sum([node_sum, exchange_cost(c, cross, shard, w.density, wire, scheme),
                          _ring(c, node, L - 1, (L - 1) * shard * wire.itemsize)]),
                    local(shard + owner * shard / N) + dense_local)  # + the node sum's flatten, gather's copy
    out = []
    for mode in modes:
        (seconds, across), local_ms = comm[mode]
        hidden = min(seconds * 1e3, w.overlap * w.compute_ms)
        out.append(Prediction(mode, w.compute_ms + local_ms + seconds * 1e3 - hidden, w.compute_ms, local_ms,
                              seconds * 1e3, across / 1e6))
    return out


def gpu_local_rate(folder: Path = REPO / "docs" / "gpu") -> tuple:
    """(elements/s, ms overhead, source) of DRAGONN's local work on a GPU: the largest CUDA fp32 record of a
    ``launch/bench_step.py`` JSON (``phases_gpu.json`` of ``launch/gpu_check.sh``) under ``folder``, as
    numel / total_ms with no separate overhead; else the stated assumption."""
    for path in sorted(folder.rglob("phases_gpu*.json")) if folder.is_dir() else []:
        recs = [r for r in json.loads(path.read_text()).get("records", [])
                if r.get("device", "").startswith("cuda") and r.get("dtype") == "float32" and r.get("total_ms")]
        if recs:
            r = max(recs, key=lambda r: r["numel"])
            return r["numel"] / r["total_ms"] * 1e3, 0.0, f"measured: {path} ({r['numel']} elements)"
    return GPU_LOCAL_RATE, GPU_LOCAL_OVERHEAD, f"ASSUMED (no docs/gpu/ benchmark): {GPU_LOCAL_OVERHEAD} ms + n / 1e11/s"


# -- validation against the testbed --------------------------------------------------------------------------------
TC_GBIT = {"100mbit": 0.1, "1gbit": 1.0, "10gbit": 10.0}  # tc rates; "unthrottled": the host's TCP is the link
TESTBEDS = {  # name: (records, nodes, ranks per node, params, ranks per core, mode renames)
    "2x2": (("docs/results/nodes/nodes_all_modes.json", "docs/results/nodes/nodes_all_modes_1gbit.json"), 2, 2,
            167178, 2.0, {}),
    "2x1": (("docs/results/link/link_1gbit_10gbit_unthrottled_120steps.json",), 2, 1, 24202250, 1.0,
            {"ds_dense_fp32": "dense_fp32", "ds_dense_bf16": "dense_bf16", "dragonn": "dragonn_flat"}),
}


def validate(alpha_us: float = TESTBED_ALPHA_US, host_gbit: float = TESTBED_HOST_GBIT, nodes_json=None) -> list:
    """Predicted against measured ms per step (and inter-node MB per node, where recorded) for every mode of every
    testbed record (``nodes_json``: a ``launch/bench_nodes.py`` record in place of the 2 x 2 ones). Compute = the
    same link's no-exchange step (else the first positive one: noise can make it negative, as at 1 Gbit/s in the
    earlier nodes.json) less its node allreduce; ``compute_from`` names the link. Times in ms, bytes in MB (1e6)
    per node."""
    rows = []
    for bed, (paths, N, L, n, oversub, names) in TESTBEDS.items():
        recs = []
        for path in [nodes_json] if nodes_json and bed == "2x2" else paths:
            data = json.loads((REPO / path).read_text())
            recs += [dict(r, mode=names.get(r["mode"], r["mode"])) for r in (data["rows"] if "rows" in data else data)]
        recs, host = [r for r in recs if r["mode"] in MODES], Link(host_gbit, alpha_us)
        w = Workload(n, 0.0, 0.01, "fp32", CPU_LOCAL_RATE / oversub, CPU_LOCAL_OVERHEAD * oversub,
                     CPU_DENSE_RATE / oversub)
        nones = {r["link"]: r["ms_per_step"] for r in recs if r["mode"] == "none" and r["ms_per_step"] > 0}
        for r in recs:
            none_link = r["link"] if r["link"] in nones else next(iter(nones))
            c = Cluster(N, L, host, Link(min(TC_GBIT.get(r["link"], math.inf), host_gbit), alpha_us))
            w = replace(w, compute_ms=nones[none_link] - predict(c, replace(w, compute_ms=0.0), ["none"])[0].step_ms)
            p = predict(c, w, [r["mode"]])[0]
            mb = r.get("inter_node_mb_per_step_per_node", r.get("tx_bytes_per_step", 0) / 1e6)  # 2x1: 1 rank a node
            rows.append({"testbed": bed, "link": r["link"], "mode": r["mode"], "compute_ms": w.compute_ms,
                         "compute_from": none_link, "measured_ms": r["ms_per_step"], "predicted_ms": p.step_ms,
                         "error_pct": (p.step_ms / r["ms_per_step"] - 1) * 100, "measured_mb": mb,
                         "predicted_mb": p.inter_mb})
    return rows


def _number(kind, upper: float = math.inf, zero: bool = False):
    """An argparse type: a ``kind`` > 0 (>= 0 with ``zero``) and <= ``upper``; an int takes ``1.3e9``, not ``2.5``."""
    def number(text: str):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not (math.isfinite(value) and (0 < value or zero and value == 0) and value <= upper) or \
                (kind is int and value != int(value)):
            what = f"{'integer' if kind is int else 'number'} {'>= 0' if zero else '> 0'}"
            raise argparse.ArgumentTypeError(f"must be a finite {what}{f' and <= {upper:g}' if upper < math.inf else ''}, "
                                             f"got {text!r}")
        return kind(value)
    return number


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python launch/bench/project.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                epilog="Defaults: a 1.3 B-parameter model on 16 nodes x 8 GPUs, NVLink inside "
                                       "(900 GB/s, 3 us), 25 and 100 Gbit/s per node across (10 us), 320 ms compute "
                                       "(16 k tokens per GPU at 40 % of 989 TFLOP/s bf16). See docs/projection.md.")
    p.add_argument("--params", type=_number(int), default=1_300_000_000, help="gradient elements (parameters)")
    p.add_argument("--nodes", type=_number(int), default=16, help="nodes N")
    p.add_argument("--ranks-per-node", type=_number(int), default=8, help="ranks (GPUs) per node L")
    p.add_argument("--intra-gbit", type=_number(float), default=7200.0, help="intra-node bandwidth per rank, Gbit/s")
    p.add_argument("--intra-latency-us", type=_number(float), default=3.0, help="intra-node latency per round, us")
    p.add_argument("--inter-gbit", type=_number(float), nargs="+", default=[25.0, 100.0],
                   help="inter-node bandwidth per node (all its NICs), Gbit/s; several values: one table each")
    p.add_argument("--inter-latency-us", type=_number(float), default=10.0, help="inter-node latency per round, us")
    p.add_argument("--compute-ms", type=_number(float), default=320.0, help="forward+backward+optimizer per step, ms")
    p.add_argument("--density", type=_number(float, 1.0), default=0.01, help="DRAGONN density, in (0, 1]")
    p.add_argument("--exchange", choices=SCHEMES, nargs="+", default=list(SCHEMES), help="DRAGONN exchange(s) shown")
    p.add_argument("--wire", choices=list(WIRE), default="bf16", help="gradient dtype, DRAGONN's values on the wire")
    p.add_argument("--select-rate", type=_number(float), default=None, help="DRAGONN local work (compensate, select, "
                   "residual, decode) per rank, elements/s; None: docs/gpu/phases_gpu.json, else 1e11, ASSUMED")
    p.add_argument("--overlap", type=_number(float, 1.0, zero=True), default=0.0,
                   help="fraction of compute that communication hides behind, [0, 1]")
    p.add_argument("--validate", nargs="?", const="", metavar="PATH", help="instead: testbeds, predicted vs measured; "
                   "PATH: a launch/bench_nodes.py nodes.json in place of the 2 x 2 records "
                   "(bare --validate: docs/results/nodes/nodes_all_modes*.json)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the result as JSON here")
    return p.parse_args(argv)


def _print(rows: List[dict], cols: dict) -> None:
    """``rows`` as a table of ``cols`` (key: format spec), headed by the keys."""
    widths = {k: max(len(k), *(len(format(r[k], f)) for r in rows)) for k, f in cols.items()}
    print(" ".join(f"{k:>{widths[k]}}" for k in cols))
    for r in rows:
        print(" ".join(f"{format(r[k], f):>{widths[k]}}" for k, f in cols.items()))


def main(argv=None) -> dict:
    a = parse_args(argv)
    if a.validate is not None:
        rows = validate(nodes_json=a.validate or None)
        print(f"testbed: {TESTBED_ALPHA_US:.0f} us a round, links capped at {TESTBED_HOST_GBIT} Gbit/s; MB: per node")
        _print(rows, {"testbed": "", "link": "", "mode": "", "compute_ms": ".1f", "measured_ms": ".1f",
                      "predicted_ms": ".1f", "error_pct": "+.0f", "measured_mb": ".4f", "predicted_mb": ".4f"})
        result = {"validation": rows, "alpha_us": TESTBED_ALPHA_US, "host_gbit": TESTBED_HOST_GBIT}
    else:
        rate, overhead, source = gpu_local_rate() if not a.select_rate else \
            (a.select_rate, GPU_LOCAL_OVERHEAD, f"given: {GPU_LOCAL_OVERHEAD} ms + n / {a.select_rate:.3g} elements/s")
        w = Workload(a.params, a.compute_ms, a.density, a.wire, rate, overhead, GPU_DENSE_RATE, a.overlap)
        shown = [m for m in MODES if all(m not in modes or s in a.exchange for s, modes in SCHEMES.items())]
        if a.ranks_per_node == 1:
            shown = [m for m in shown if m not in NODE_MODES]
        print(f"{a.params / 1e9:.3g} B parameters, {a.nodes} x {a.ranks_per_node} ranks, compute {a.compute_ms} ms, "
              f"density {a.density}, {a.wire}, overlap {a.overlap}; local work: dense n / 2.5e11/s (ASSUMED), "
              f"DRAGONN {source}")
        if a.ranks_per_node == 1:
            print(f"1 rank per node: {', '.join(NODE_MODES)} equal dense_bf16 and the flat modes, not shown")
        result = {"args": vars(a), "local_work": source, "tables": {}}
        for gbit in a.inter_gbit:
            intra, inter = Link(a.intra_gbit, a.intra_latency_us), Link(gbit, a.inter_latency_us)
            preds = [p._asdict() for p in predict(Cluster(a.nodes, a.ranks_per_node, intra, inter), w, shown)]
            bf16 = next(q["step_ms"] for q in preds if q["mode"] == "dense_bf16")  # always shown
            for p in preds:
                p["speedup_vs_dense_bf16"] = bf16 / p["step_ms"]
            print(f"\ninter-node {gbit:g} Gbit/s per node")
            _print(preds, {"mode": "", "step_ms": ".1f", "local_ms": ".1f", "comm_ms": ".1f", "inter_mb": ".1f",
                           "speedup_vs_dense_bf16": ".2f"})
            result["tables"][f"{gbit:g}"] = preds
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
