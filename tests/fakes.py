"""A stand-in for a DeepSpeed engine, for unit tests of the hook's state handling (no process group)."""
from __future__ import annotations

from types import SimpleNamespace

import torch


def fake_engine(**overrides) -> SimpleNamespace:
    """The engine attributes ``HookBase`` reads (ZeRO stage 0, fp32, CPU, step 0); ``overrides`` replace them."""
    fields = dict(module=torch.nn.Linear(2, 2), global_steps=0, skipped_steps=0,
                  zero_optimization_stage=lambda: 0, zero_reduce_bucket_size=lambda: 500_000_000,
                  communication_data_type=torch.float32, device=torch.device("cpu"))
    fields.update(overrides)
    return SimpleNamespace(**fields)
