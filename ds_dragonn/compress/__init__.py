"""Compress: select the (index, value) pairs each rank sends (DRAGONN; the top-k and random-k baselines live in
``launch/bench/baselines.py``)."""
from .. import constants
from .base import EMPTY_SLOT, MAX_PAIRS_FACTOR, Compressor, Selection, index_dtype, max_pairs, target_k
from .dragonn import DragonnCompressor


def build_compressor(cfg) -> DragonnCompressor:
    """The DRAGONN compressor of a :class:`ds_dragonn.config.DragonnConfig`, chunk-wise (``constants.CHUNK_SIZE``)
    under ``advanced.selection: chunked``. Raises ValueError for an unknown selection."""
    selection = getattr(getattr(cfg, "selection", "global"), "value", getattr(cfg, "selection", "global"))
    if selection not in ("global", "chunked"):
        raise ValueError(f"unknown selection {selection!r}; choose 'global' or 'chunked'")
    chunk = constants.CHUNK_SIZE if selection == "chunked" else None
    kernel = getattr(cfg, "kernel", "auto")
    return DragonnCompressor(cfg.density, constants.SAMPLE_RATIO, constants.MIN_SAMPLE, constants.TABLE_FACTOR,
                             kernel=getattr(kernel, "value", kernel), chunk=chunk)


__all__ = ["EMPTY_SLOT", "Compressor", "Selection", "DragonnCompressor", "MAX_PAIRS_FACTOR", "build_compressor",
           "index_dtype", "max_pairs", "target_k"]
