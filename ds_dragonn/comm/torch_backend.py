"""Collectives over ``deepspeed.comm`` (NCCL on GPU, gloo on CPU)."""
from __future__ import annotations

import warnings
from typing import Any, List, Optional, Sequence

import torch
import deepspeed.comm as dist

from .base import CommBackend

# deepspeed.comm 0.19.8 calls torch's all_gather_into_tensor, which torch 2.13 flags on every call
warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)


class TorchCommBackend(CommBackend):
    """``deepspeed.comm`` collectives on ``group`` (None = the world group)."""

    name = "torch"

    def __init__(self, group: Optional[Any] = None):
        self.group = group

    @property
    def rank(self) -> int:
        return dist.get_rank(group=self.group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(group=self.group)

    def all_gather_ints(self, values: Sequence[int] | torch.Tensor, device: torch.device) -> List[List[int]]:
        local = (values.to(device=device, dtype=torch.int64).reshape(-1) if torch.is_tensor(values)
                 else torch.tensor(list(values), dtype=torch.int64, device=device))
        out = torch.empty(self.world_size * local.numel(), dtype=torch.int64, device=device)
        try:
            dist.all_gather_into_tensor(out, local, group=self.group)
        except Exception as err:  # noqa: BLE001 - re-raised with the rank
            raise self._fail("all_gather_into_tensor(header)", err) from err
        return out.view(self.world_size, -1).tolist()  # the one read-back: the sizes the payload needs

    def all_gather_bytes(self, payload: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.world_size * payload.numel(), dtype=torch.uint8, device=payload.device)
        try:
            dist.all_gather_into_tensor(out, payload, group=self.group)
        except Exception as err:  # noqa: BLE001
            raise self._fail("all_gather_into_tensor(payload)", err) from err
        return out.view(self.world_size, -1)

    def all_to_all_bytes(self, payload: torch.Tensor, send_sizes: Sequence[int],
                         recv_sizes: Sequence[int]) -> torch.Tensor:
        out = torch.empty(int(sum(recv_sizes)), dtype=torch.uint8, device=payload.device)
        try:
            dist.all_to_all_single(out, payload, output_split_sizes=[int(v) for v in recv_sizes],
                                   input_split_sizes=[int(v) for v in send_sizes], group=self.group)
        except Exception as err:  # noqa: BLE001
            raise self._fail("all_to_all_single(payload)", err) from err
        return out

    def all_reduce_sum_(self, tensor: torch.Tensor) -> None:
        try:
            dist.all_reduce(tensor, group=self.group)
        except Exception as err:  # noqa: BLE001
            raise self._fail("all_reduce", err) from err
