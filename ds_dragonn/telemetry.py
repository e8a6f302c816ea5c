"""Counters of what gradient synchronisation cost, logged in DeepSpeed's style and sent to its monitor.

Monitor events (``engine.monitor``, written on rank 0 by DeepSpeed's ``MonitorMaster``) go out on every reduction,
on DeepSpeed's x-axis (the global sample count, as its ``Train/Samples/*`` series). See docs/usage.md, 'Logs,
telemetry, monitor events'.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import List, Optional, Tuple

from deepspeed.utils.logging import print_dist

from .exchange.wire import dense_allreduce_bytes
from .pipeline import ReduceStats

PHASES = ("compensate", "select", "exchange", "residual", "decode")


@dataclass
class Telemetry:
    """Running totals on this rank (all buckets, dense and compressed).

    ``bytes_sent`` counts the dense allreduces too (warm-up, small buffers, auto policy), so
    ``bytes_sent / dense_bytes_equivalent`` is the whole run's traffic ratio. Times in ms. Under
    ``sync: local_steps`` each local step adds one dense allreduce's bytes to ``dense_bytes_equivalent``
    (what dense data-parallel training would have sent) and nothing to ``bytes_sent``; the outer steps add
    their bytes to ``bytes_sent`` and ``outer_bytes_sent`` (and, compressed, to ``compressed_bytes_sent``, while
    ``compressed_dense_bytes`` stays 0: they replace no dense collective of their own). On the node-aware
    hierarchy each local step's dense gradient average inside the node goes to ``node_bytes_sent`` (the fast
    link), not to ``bytes_sent``, which counts what crosses nodes.
    """
    compressed_reductions: int = 0
    dense_reductions: int = 0
    bytes_sent: int = 0
    dense_bytes_equivalent: int = 0
    compressed_bytes_sent: int = 0
    compressed_dense_bytes: int = 0
    kept: int = 0
    target_k: int = 0
    compressed_numel: int = 0
    timed_reductions: int = 0  # compressed reductions whose phases were timed (the ms totals are over these)
    compress_ms_total: float = 0.0
    compensate_ms_total: float = 0.0
    select_ms_total: float = 0.0
    exchange_ms_total: float = 0.0
    residual_ms_total: float = 0.0
    decode_ms_total: float = 0.0
    dense_ms_total: float = 0.0
    bytes_received: int = 0  # compressed reductions only
    max_imbalance: float = 0.0  # partitioned exchange: worst owner max/mean seen
    local_steps_taken: int = 0  # sync: local_steps: optimizer steps that exchanged nothing
    outer_syncs: int = 0  # sync: local_steps: outer steps (rounds ended)
    outer_bytes_sent: int = 0  # sync: local_steps: bytes of the pseudo-gradient exchanges
    node_bytes_sent: int = 0  # sync: local_steps, node-aware: bytes of the gradient averages inside the node
    node_ms_total: float = 0.0  # sync: local_steps, node-aware: their time

    def record_dense(self, numel: int, itemsize: int, world_size: int, ms: float = 0.0,
                     bytes_sent: Optional[int] = None, quantized_bytes: Optional[int] = None) -> None:
        """A dense reduction of ``numel`` elements; ``bytes_sent`` (what the dense collective sends) defaults to
        a ring allreduce's; ``quantized_bytes``: what it sent instead, its values quantized
        (``advanced.dense_values``)."""
        b = dense_allreduce_bytes(numel, itemsize, world_size) if bytes_sent is None else int(bytes_sent)
        self.dense_reductions += 1
        self.bytes_sent += b if quantized_bytes is None else int(quantized_bytes)
        self.dense_bytes_equivalent += b
        self.dense_ms_total += ms

    def record_local(self, numel: int, itemsize: int, world_size: int) -> None:
        """``sync: local_steps``: an optimizer step that exchanged nothing. It counts what dense data-parallel
        training would have sent for it (one allreduce of ``numel`` gradient elements), so that
        :attr:`bytes_ratio` compares with dense synchronous training, not with one dense round."""
        self.local_steps_taken += 1
        self.dense_bytes_equivalent += dense_allreduce_bytes(numel, itemsize, world_size)

    def record_node(self, bytes_sent: int, ms: float = 0.0) -> None:
        """``sync: local_steps``, node-aware: a local step's dense gradient average inside the node sent
        ``bytes_sent`` on the fast link (nothing across nodes)."""
        self.node_bytes_sent += int(bytes_sent)
        self.node_ms_total += ms

    def record_outer(self, bytes_sent: int, s: Optional[ReduceStats] = None) -> None:
        """``sync: local_steps``: one outer step sent ``bytes_sent`` (its dense equivalent is already in the
        round's :meth:`record_local` steps); ``s``: the compressed exchange's statistics (None: dense)."""
        self.outer_syncs += 1
        self.outer_bytes_sent += int(bytes_sent)
        self.bytes_sent += int(bytes_sent)
        if s is not None:
            self._add_compressed(s)

    def record_compressed(self, s: ReduceStats) -> None:
        self.bytes_sent += s.bytes_sent
        self.dense_bytes_equivalent += s.dense_bytes
        self.compressed_dense_bytes += s.dense_bytes
        self._add_compressed(s)

    def _add_compressed(self, s: ReduceStats) -> None:
        self.compressed_reductions += 1
        self.compressed_bytes_sent += s.bytes_sent
        self.kept += s.kept
        self.target_k += s.k
        self.compressed_numel += s.numel
        self.bytes_received += s.bytes_received
        self.max_imbalance = max(self.max_imbalance, s.imbalance)
        if getattr(s, "timed", True):  # an untimed CUDA reduction's laps are 0.0, not times
            self.timed_reductions += 1
            self.compress_ms_total += s.compress_ms
            for p in PHASES:
                setattr(self, f"{p}_ms_total", getattr(self, f"{p}_ms_total") + getattr(s, f"{p}_ms"))

    @property
    def kept_over_k(self) -> float:
        return self.kept / self.target_k if self.target_k else 0.0

    @property
    def achieved_density(self) -> float:
        """Pairs sent / elements of the compressed buffers (the configured density × kept/k)."""
        return self.kept / self.compressed_numel if self.compressed_numel else 0.0

    @property
    def compress_ms_mean(self) -> float:
        return self.compress_ms_total / self.timed_reductions if self.timed_reductions else 0.0

    @property
    def bytes_ratio(self) -> float:
        return self.bytes_sent / self.dense_bytes_equivalent if self.dense_bytes_equivalent else 0.0

    def phase_means(self) -> dict:
        """Mean ms per timed compressed reduction of each phase, and per dense reduction (``dense_ms_mean``)."""
        c = self.timed_reductions
        d = {f"{p}_ms_mean": getattr(self, f"{p}_ms_total") / c if c else 0.0 for p in PHASES}
        d["dense_ms_mean"] = self.dense_ms_total / self.dense_reductions if self.dense_reductions else 0.0
        return d

    def summary(self) -> dict:
        d = asdict(self)
        d["compress_ms_mean"] = self.compress_ms_mean
        d["kept_over_k"] = self.kept_over_k
        d["achieved_density"] = self.achieved_density
        d["bytes_ratio"] = self.bytes_ratio
        d.update(self.phase_means())
        return d


def log_reduction(step: int, s: ReduceStats) -> None:
    """One statistics line on rank 0 for a compressed reduction (DeepSpeed's ``print_dist`` style)."""
    ratio = s.bytes_sent / s.dense_bytes if s.dense_bytes else 0.0
    phases = " ".join(f"{p}={getattr(s, p + '_ms'):.2f}" for p in PHASES)
    print_dist(f"DRAGONN step={step} numel={s.numel} kept={s.kept} k={s.k} kept/k={s.kept / max(s.k, 1):.3f} "
               f"bytes={s.bytes_sent} dense_bytes={s.dense_bytes} ratio={ratio:.4f} "
               f"{f'imbalance={s.imbalance:.3f} ' if s.imbalance else ''}"
               f"compress_ms={s.compress_ms:.2f} ms: {phases}", ranks=[0])


def monitor_events(t: Telemetry, samples: int, s: Optional[ReduceStats] = None,
                   dense_ms: Optional[float] = None) -> List[Tuple[str, float, int]]:
    """DeepSpeed monitor events for one reduction at x = ``samples`` (global samples of the step).

    Args:
        t: the running totals, already updated with this reduction.
        s: the compressed reduction's statistics, or None for a dense one (then ``dense_ms`` is its time).
    """
    ev = [("Train/dragonn/compressed", 1.0 if s is not None else 0.0, samples),
          ("Train/dragonn/total_bytes_sent", float(t.bytes_sent), samples),
          ("Train/dragonn/total_dense_bytes_equivalent", float(t.dense_bytes_equivalent), samples),
          ("Train/dragonn/total_bytes_ratio", t.bytes_ratio, samples),
          ("Train/dragonn/achieved_density", t.achieved_density, samples)]
    if s is not None:
        ev += [("Train/dragonn/kept_over_k", s.kept / max(s.k, 1), samples),
               ("Train/dragonn/bytes_ratio", s.bytes_sent / s.dense_bytes if s.dense_bytes else 0.0, samples),
               ("Train/dragonn/compress_ms", s.compress_ms, samples)]
        if s.imbalance:
            ev.append(("Train/dragonn/owner_imbalance", s.imbalance, samples))
        ev += [(f"Train/dragonn/{p}_ms", getattr(s, f"{p}_ms"), samples) for p in PHASES]
    elif dense_ms is not None:
        ev.append(("Train/dragonn/dense_ms", dense_ms, samples))
    return ev
