"""Exchange: move each rank's selected pairs to the ranks that decode them (one interface, three schemes).

``allgather`` and ``partitioned`` serve ZeRO stage 0 (``build_exchange``); ``reduce_scatter``
(``exchange/reduce_scatter.py``) serves ZeRO stages 1 and 2, whose owners are ZeRO's partitions."""
from .allgather import AllgatherExchange, allgather_exchange
from .base import BufferMismatchError, Exchange, Gathered, check_buffer_agreement
from .wire import to_wire
from .ownership import HashedOwnership, Ownership
from .partitioned import PartitionedExchange, Scattered, sparse_reduce_scatter
from .quantize import PLAIN, ValueCodec, ValueFormat, value_codec


def build_exchange(cfg, backend, compressor, transactional: bool = False) -> Exchange:
    """The scheme named by ``cfg.exchange`` over ``backend`` (``compressor``: the partitioned owners';
    ``transactional``: steps may be skipped, so a step's changes to scheme state can be undone), its values in
    the format of ``cfg.values`` (``advanced.values``)."""
    name = cfg.exchange.value if hasattr(cfg.exchange, "value") else str(cfg.exchange)
    values = value_codec(getattr(cfg, "values", None))
    if name == "allgather":
        return AllgatherExchange(backend, values)
    if name == "partitioned":
        return PartitionedExchange(backend, compressor, cfg.error_feedback, transactional, values)
    raise ValueError(f"unknown exchange {name!r}; choose 'allgather' or 'partitioned'")


__all__ = ["AllgatherExchange", "BufferMismatchError", "Exchange", "Gathered",
           "HashedOwnership", "Ownership", "PLAIN", "PartitionedExchange", "Scattered", "ValueCodec", "ValueFormat",
           "allgather_exchange", "build_exchange", "check_buffer_agreement", "sparse_reduce_scatter", "to_wire",
           "value_codec"]
