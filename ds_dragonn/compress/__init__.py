"""Compress: select the (index, value) pairs each rank sends. One interface, several methods."""
from .base import EMPTY_SLOT, MAX_PAIRS_FACTOR, Compressor, Selection, index_dtype, max_pairs, target_k
from .dragonn import DragonnCompressor
from .randomk import RandomKCompressor
from .topk import TopKCompressor

COMPRESSORS = {c.name: c for c in (DragonnCompressor, TopKCompressor, RandomKCompressor)}


def build_compressor(cfg) -> Compressor:
    """The compressor named by a :class:`ds_dragonn.config.DragonnConfig`."""
    name = cfg.compressor.value if hasattr(cfg.compressor, "value") else str(cfg.compressor)
    if name == "dragonn":
        kernel = getattr(cfg, "kernel", "auto")
        return DragonnCompressor(cfg.density, cfg.sample_ratio, cfg.min_sample, cfg.table_factor,
                                 kernel=getattr(kernel, "value", kernel))
    if name not in COMPRESSORS:
        raise ValueError(f"unknown compressor {name!r}; choose one of {sorted(COMPRESSORS)}")
    return COMPRESSORS[name](cfg.density)


__all__ = ["EMPTY_SLOT", "Compressor", "Selection", "DragonnCompressor", "TopKCompressor",
           "RandomKCompressor", "COMPRESSORS", "MAX_PAIRS_FACTOR", "build_compressor", "index_dtype", "max_pairs",
           "target_k"]
