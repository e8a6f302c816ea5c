"""Counters of what gradient synchronisation cost, logged in DeepSpeed's style and sent to its monitor."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from deepspeed.utils.logging import print_dist

from .pipeline import ReduceStats, dense_allreduce_bytes


@dataclass
class Telemetry:
    """Running totals on this rank (all buckets, dense and compressed).

    ``bytes_sent`` counts the dense allreduces too (warm-up, small buffers), so
    ``bytes_sent / dense_bytes_equivalent`` is the whole run's traffic ratio.
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
    compress_ms_total: float = 0.0

    def record_dense(self, numel: int, itemsize: int, world_size: int) -> None:
        b = dense_allreduce_bytes(numel, itemsize, world_size)
        self.dense_reductions += 1
        self.bytes_sent += b
        self.dense_bytes_equivalent += b

    def record_compressed(self, s: ReduceStats) -> None:
        self.compressed_reductions += 1
        self.bytes_sent += s.bytes_sent
        self.dense_bytes_equivalent += s.dense_bytes
        self.compressed_bytes_sent += s.bytes_sent
        self.compressed_dense_bytes += s.dense_bytes
        self.kept += s.kept
        self.target_k += s.k
        self.compressed_numel += s.numel
        self.compress_ms_total += s.compress_ms

    @property
    def kept_over_k(self) -> float:
        return self.kept / self.target_k if self.target_k else 0.0

    @property
    def achieved_density(self) -> float:
        """Pairs sent / elements of the compressed buffers (the configured density × kept/k)."""
        return self.kept / self.compressed_numel if self.compressed_numel else 0.0

    @property
    def compress_ms_mean(self) -> float:
        return self.compress_ms_total / self.compressed_reductions if self.compressed_reductions else 0.0

    def summary(self) -> dict:
        d = asdict(self)
        d["compress_ms_mean"] = self.compress_ms_mean
        d["kept_over_k"] = self.kept_over_k
        d["achieved_density"] = self.achieved_density
        d["bytes_ratio"] = self.bytes_sent / self.dense_bytes_equivalent if self.dense_bytes_equivalent else 0.0
        return d


def log_reduction(step: int, s: ReduceStats, monitor: Optional[object] = None) -> None:
    """One line per compressed reduction on rank 0, plus monitor events when DeepSpeed's monitor is on."""
    ratio = s.bytes_sent / s.dense_bytes if s.dense_bytes else 0.0
    print_dist(f"DRAGONN step={step} numel={s.numel} kept={s.kept} k={s.k} kept/k={s.kept / max(s.k, 1):.3f} "
               f"bytes={s.bytes_sent} dense_bytes={s.dense_bytes} ratio={ratio:.4f} "
               f"compress_ms={s.compress_ms:.2f}", ranks=[0])
    if monitor is not None and getattr(monitor, "enabled", False):
        monitor.write_events([("Train/dragonn/kept_over_k", s.kept / max(s.k, 1), step),
                              ("Train/dragonn/bytes_ratio", ratio, step),
                              ("Train/dragonn/compress_ms", s.compress_ms, step)])
