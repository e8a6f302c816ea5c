"""Counting the calls that would read a CUDA device back to the host, in-process on CPU.

:class:`MirrorDist` stands in for ``deepspeed.comm`` in ``comm/torch_backend.py``: ``world`` ranks that all hold
this rank's tensors (every rank sends what this one sends), so a compressed reduction of any exchange runs its
real code path, collectives included, in one process. :func:`count_syncs` wraps the ``torch.Tensor`` methods and
``torch.cuda.synchronize`` that force a host read-back on CUDA and counts the calls made from ``ds_dragonn/``.
"""
from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from types import SimpleNamespace

import torch

import ds_dragonn

PACKAGE = os.path.dirname(os.path.abspath(ds_dragonn.__file__)) + os.sep
# CPU-only kernel wrappers never run on a CUDA tensor (their Triton counterparts do, and are counted)
CPU_ONLY = (os.path.join(PACKAGE, "compress", "kernels", "cpu_table.py"),)
# reads of tensors that stay on the host when the model is on a GPU: torch's Adam keeps ``state["step"]`` on the
# CPU (unless ``capturable``/``fused``, where this read is a sync: docs/design.md, "Device syncs per bucket")
HOST_RESIDENT = {(os.path.join(PACKAGE, "engine", "variance.py"), "_step_count")}
SYNCING_METHODS = ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "__index__", "cpu")


class MirrorDist(SimpleNamespace):
    """``deepspeed.comm``'s collectives for ``world`` ranks that hold identical tensors (this rank's)."""

    def __init__(self, world: int = 2, rank: int = 0):
        super().__init__(world=world, rank=rank)

    def get_rank(self, group=None) -> int:
        return self.rank

    def get_world_size(self, group=None) -> int:
        return self.world

    def all_gather_into_tensor(self, out, local, group=None):
        out.view(self.world, -1).copy_(local.reshape(1, -1).expand(self.world, -1))

    def all_to_all_single(self, out, inp, output_split_sizes=None, input_split_sizes=None, group=None):
        # rank r sends this rank the part addressed to it, which, all ranks being equal, is our own part for us
        start = sum(input_split_sizes[:self.rank])
        mine = inp[start:start + input_split_sizes[self.rank]]
        out.view(self.world, -1).copy_(mine.reshape(1, -1).expand(self.world, -1))

    def all_reduce(self, tensor, group=None):
        tensor.mul_(self.world)


@contextlib.contextmanager
def mirrored(world: int = 2):
    """Patch ``comm/torch_backend.py``'s ``dist`` with :class:`MirrorDist`; yields a ``TorchCommBackend``."""
    from ds_dragonn.comm import torch_backend
    saved = torch_backend.dist
    torch_backend.dist = MirrorDist(world)
    try:
        yield torch_backend.TorchCommBackend()
    finally:
        torch_backend.dist = saved


def _caller_in_package(skip: int = 0) -> str | None:
    """``file:line`` of the innermost caller frame inside ``ds_dragonn/`` (skipping CPU-only wrappers), or None
    when the call came from elsewhere (tests, torch, deepspeed)."""
    f = sys._getframe(2 + skip)
    if f is not None and f.f_code.co_filename.startswith(PACKAGE):
        name = f.f_code.co_filename
        if name.startswith(CPU_ONLY) or (name, f.f_code.co_name) in HOST_RESIDENT:
            return None
        return f"{os.path.relpath(name, os.path.dirname(PACKAGE))}:{f.f_lineno}"
    return None


@contextlib.contextmanager
def count_syncs():
    """Counts, in the yielded :class:`collections.Counter` keyed ``"file:line method"``, every call from
    ``ds_dragonn/`` (its direct caller) that reads a CUDA device back: the methods in ``SYNCING_METHODS`` and
    ``torch.cuda.synchronize``, and indexing with a boolean mask (``"mask_index"``). A ``__bool__``/``__int__``/``__float__`` reached through ``item`` is counted once."""
    counts: Counter = Counter()
    saved = {m: getattr(torch.Tensor, m) for m in SYNCING_METHODS}
    saved_sync = torch.cuda.synchronize
    depth = [0]

    def wrap(name, fn, skip=0):
        def counted(*args, **kwargs):
            if depth[0] == 0:
                where = _caller_in_package(skip)
                if where is not None:
                    counts[f"{where} {name}"] += 1
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return counted

    for m, fn in saved.items():
        setattr(torch.Tensor, m, wrap(m, fn))
    # indexing with a boolean mask sizes its result from the mask: an implicit nonzero, a sync on CUDA
    getitem = torch.Tensor.__getitem__
    masked = wrap("mask_index", getitem, skip=1)

    def index(self, key):
        keys = key if isinstance(key, tuple) else (key,)
        if any(isinstance(k, torch.Tensor) and k.dtype == torch.bool for k in keys):
            return masked(self, key)
        return getitem(self, key)
    torch.Tensor.__getitem__ = index
    torch.cuda.synchronize = wrap("synchronize", lambda *a, **k: None)
    try:
        yield counts
    finally:
        for m, fn in saved.items():
            setattr(torch.Tensor, m, fn)
        torch.Tensor.__getitem__ = getitem
        torch.cuda.synchronize = saved_sync
