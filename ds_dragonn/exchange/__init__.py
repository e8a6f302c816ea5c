"""Exchange: move each rank's selected pairs to the ranks that decode them."""
from .allgather import BufferMismatchError, Gathered, allgather_exchange

__all__ = ["BufferMismatchError", "Gathered", "allgather_exchange"]
