"""The collective primitives every exchange scheme is written against.

An exchange scheme (``ds_dragonn.exchange``) needs only these four collectives, so each transport —
``deepspeed.comm`` (NCCL/gloo) or mpi4py — implements them once and every scheme runs on every
transport unchanged (one signature for every backend; DeepSpeed's near-duplicate ``nccl.py``/``mpi.py``
are the counter-example). Failures are re-raised as :class:`CommError` naming the rank.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import List, Sequence

import torch


class CommError(RuntimeError):
    """A collective failed; the message names the rank and the operation."""


class CommBackend(ABC):
    """Collectives over one data-parallel group of ``world_size`` ranks."""

    name: str = "base"

    @property
    @abstractmethod
    def rank(self) -> int:
        ...

    @property
    @abstractmethod
    def world_size(self) -> int:
        ...

    @abstractmethod
    def all_gather_ints(self, values: Sequence[int] | torch.Tensor, device: torch.device) -> List[List[int]]:
        """Gather a short list of ints (same length on every rank) from every rank: result[r] is rank r's.

        ``values`` may be a (m,) integer tensor on ``device``: ints computed on the device (a count, a flag)
        then travel without a read-back of their own, and the gathered rows are the one read-back."""

    @abstractmethod
    def all_gather_bytes(self, payload: torch.Tensor) -> torch.Tensor:
        """Gather a (L,) uint8 tensor (same L on every rank) → (world_size, L) uint8 on payload's device."""

    @abstractmethod
    def all_to_all_bytes(self, payload: torch.Tensor, send_sizes: Sequence[int],
                         recv_sizes: Sequence[int]) -> torch.Tensor:
        """Personalised exchange of bytes (variable sizes): rank r's block j goes to rank j.

        Args:
            payload: (Σ send_sizes,) uint8; block j (``send_sizes[j]`` bytes, in rank order) is for rank j.
            send_sizes: bytes this rank sends to each rank (``world_size`` ints, self included).
            recv_sizes: bytes this rank receives from each rank; must equal what each sender sends it
                (the caller exchanges the sizes first, e.g. with :meth:`all_gather_ints`).
        Returns:
            (Σ recv_sizes,) uint8 on ``payload``'s device: block r (``recv_sizes[r]`` bytes) from rank r.
        """

    @abstractmethod
    def all_reduce_sum_(self, tensor: torch.Tensor) -> None:
        """In-place sum of a dense tensor over all ranks."""

    def _fail(self, op: str, err: BaseException) -> CommError:
        return CommError(f"[rank {self.rank}] {self.name} {op} failed: {err}")
