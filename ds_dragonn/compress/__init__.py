"""Compress: select the (index, value) pairs each rank sends. One interface, several methods."""
from .. import constants
from .base import EMPTY_SLOT, MAX_PAIRS_FACTOR, Compressor, Selection, index_dtype, max_pairs, target_k
from .dragonn import DragonnCompressor
from .randomk import RandomKCompressor
from .topk import TopKCompressor

COMPRESSORS = {c.name: c for c in (DragonnCompressor, TopKCompressor, RandomKCompressor)}


def build_compressor(cfg) -> Compressor:
    """The compressor named by a :class:`ds_dragonn.config.DragonnConfig` (``advanced.compressor``), chunk-wise
    (``constants.CHUNK_SIZE``) under ``advanced.selection: chunked``. Raises ValueError for an unknown name."""
    name = cfg.compressor.value if hasattr(cfg.compressor, "value") else str(cfg.compressor)
    selection = getattr(getattr(cfg, "selection", "global"), "value", getattr(cfg, "selection", "global"))
    if selection not in ("global", "chunked"):
        raise ValueError(f"unknown selection {selection!r}; choose 'global' or 'chunked'")
    chunk = constants.CHUNK_SIZE if selection == "chunked" else None
    if name == "dragonn":
        kernel = getattr(cfg, "kernel", "auto")
        return DragonnCompressor(cfg.density, constants.SAMPLE_RATIO, constants.MIN_SAMPLE, constants.TABLE_FACTOR,
                                 kernel=getattr(kernel, "value", kernel), chunk=chunk)
    if name not in COMPRESSORS:
        raise ValueError(f"unknown compressor {name!r}; choose one of {sorted(COMPRESSORS)}")
    return COMPRESSORS[name](cfg.density, chunk=chunk)


__all__ = ["EMPTY_SLOT", "Compressor", "Selection", "DragonnCompressor", "TopKCompressor",
           "RandomKCompressor", "COMPRESSORS", "MAX_PAIRS_FACTOR", "build_compressor", "index_dtype", "max_pairs",
           "target_k"]
