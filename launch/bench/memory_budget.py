"""Memory budget: the persistent bytes ds_dragonn may keep per element of a compressed bucket, and a counter.

A persistent tensor is one the hook keeps between steps (residuals, momenta, decode buffers, the partitioned
exchange's server residual, ...; the momentum mode's frozen variance lives in Adam's own ``exp_avg_sq``). :func:`persistent_tensors` finds them by walking
the hook object (``engine.dragonn``) and every ds_dragonn object reachable from it; tensors that share
storage with the model's parameters, gradients or optimizer state are DeepSpeed's and are not counted.

:func:`budget` states, per component, the bytes per parameter of the compressed buckets that a rank may keep
in a given mode and layout. The stated budget is the ceiling a change must not exceed
(``tests/test_memory_budget.py``); ``docs/design.md``
("Memory budget per bucket") gives the table.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, Iterator, Optional, Tuple

import torch

#: the persistent stores and the path fragment (as :func:`persistent_tensors` names it) that finds each
COMPONENTS = (
    (".error_feedback.undo._work", "residual working copy"), (".error_feedback.residuals", "residual"),
    (".momentum.undo._work", "momentum working copy"), (".momentum.momenta", "momentum"),
    ("decoder._acc", "decode accumulator"), ("decoder._out", "decode buffer"),
    (".server.residuals", "server residual"), (".server.undo", "server undo log"),
)

#: the fp32 stores of the rank's shard (one element per bucket element) in each ``compress`` mode
_MODE_STORES = {"gradient": ("residual",), "momentum": ("residual", "momentum")}
#: the exchanges' fp32 stores of the rank's 1/world part of each bucket (the others keep none)
_EXCHANGE_STORES = {"partitioned": ("server residual",)}


def component_of(path: str) -> str:
    """The store a persistent tensor's path (:func:`persistent_tensors`) lies in, or ``"other"``."""
    for fragment, name in COMPONENTS:
        if fragment in path:
            return name
    return "other"


def _is_ours(obj: Any) -> bool:
    return type(obj).__module__.startswith("ds_dragonn")


def _children(obj: Any) -> Iterable[Tuple[str, Any]]:
    if isinstance(obj, dict):
        return ((f"[{k!r}]", v) for k, v in obj.items())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return ((f"[{i}]", v) for i, v in enumerate(obj))
    if _is_ours(obj):
        fields = dict(getattr(obj, "__dict__", {}))
        for name in getattr(type(obj), "__slots__", ()):
            if hasattr(obj, name):
                fields[name] = getattr(obj, name)
        return ((f".{k}", v) for k, v in fields.items())
    return ()


def deepspeed_storages(engine: Any) -> set:
    """Storage addresses of the engine's parameters, gradients and optimizer state (not ours to count)."""
    ptrs = set()
    tensors = []
    module = getattr(engine, "module", None)
    if module is not None:
        for p in module.parameters():
            tensors += [p, p.grad] if p.grad is not None else [p]
    opt = getattr(engine, "optimizer", None)
    for o in (opt, getattr(opt, "optimizer", None)):
        for state in getattr(o, "state", {}).values() if o is not None else ():
            tensors += [v for v in (state.values() if isinstance(state, dict) else ()) if torch.is_tensor(v)]
        for group in getattr(o, "param_groups", ()) if o is not None else ():
            tensors += [p for p in group.get("params", ()) if torch.is_tensor(p)]
            tensors += [p.grad for p in group.get("params", ()) if torch.is_tensor(p) and p.grad is not None]
    for name in ("single_partition_of_fp32_groups", "bit16_groups_flat", "fp32_groups_flat_partition",
                 "averaged_gradients", "fp16_partitioned_groups_flat", "fp32_partitioned_groups_flat"):
        for t in _flat_tensors(getattr(opt, name, None)):
            tensors.append(t)
    for t in tensors:
        if t is not None and t.numel():
            ptrs.add(t.untyped_storage().data_ptr())
    return ptrs


def _flat_tensors(obj: Any) -> Iterator[torch.Tensor]:
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _flat_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _flat_tensors(v)


def persistent_tensors(hook: Any, exclude: set = frozenset()) -> Dict[str, Tuple[int, torch.Tensor]]:
    """Every tensor storage reachable from ``hook`` through ds_dragonn objects and containers.

    Args:
        hook: the installed hook (``engine.dragonn``) or any ds_dragonn object.
        exclude: storage addresses not to count (:func:`deepspeed_storages`).
    Returns:
        {first path found: (storage bytes, tensor)}, one entry per distinct storage.
    """
    seen_obj, seen_storage, out = set(), set(exclude), {}
    stack = [("hook", hook)]
    while stack:
        path, obj = stack.pop()
        if torch.is_tensor(obj):
            if obj.numel() == 0 or obj.device.type == "meta":
                continue
            storage = obj.untyped_storage()
            if storage.data_ptr() in seen_storage:
                continue
            seen_storage.add(storage.data_ptr())
            out[path] = (storage.nbytes(), obj)
            continue
        if id(obj) in seen_obj or isinstance(obj, (str, bytes, int, float, bool, type(None))):
            continue
        seen_obj.add(id(obj))
        stack.extend((path + name, child) for name, child in _children(obj))
    return out


def budget(compress: str, wire: torch.dtype, transactional: bool, stage: int = 0, world: int = 1,
           per_node: int = 1, exchange: str = "allgather", decode_into: Optional[bool] = None) -> Dict[str, float]:
    """The stated ceiling per component, in bytes per parameter of the compressed buckets, per rank.

    Args:
        compress: "gradient" or "momentum".
        wire: the buckets' wire dtype (bf16, fp32 or fp16).
        transactional: a skipped step leaves no trace (``plan.step_transaction``: fp16, or
            ``advanced.exact_skipped_steps``): the residual and the momentum keep a working copy.
        stage: the ZeRO stage.
        world: data-parallel ranks (ZeRO's partition count; the partitioned exchange's owners).
        per_node: ranks per node of the node-aware layout (1: flat); the residual, momentum and decode
            buffer hold the rank's 1/per_node shard.
        exchange: "allgather", "partitioned" or "reduce_scatter".
        decode_into: the decode lands in the gradients, DeepSpeed's bucket or the node's shard (no decode
            buffer); None: where it does (flat ZeRO 0 with CPU fp32/bf16 gradients; flat ZeRO 1-3 in bf16/fp32, into
            DeepSpeed's bucket buffer or the rank-major copy; node-aware with an fp32 wire, the shard's dtype).
    Returns:
        {component name (:data:`COMPONENTS`): bytes per parameter}; absent components are 0.
    """
    if decode_into is None:
        decode_into = ((per_node == 1 and (stage == 0 or wire != torch.float16))
                       or (per_node > 1 and wire == torch.float32))
    copies = 2 if transactional else 1  # exact: a working copy of each of the rank's stores (``undo.WorkingCopies``)
    shard = {name: 4.0 / per_node for name in _MODE_STORES[compress]}
    out = {**shard, **{f"{name} working copy": (copies - 1) * b for name, b in shard.items()},
           **{name: 4.0 * copies / world for name in _EXCHANGE_STORES.get(exchange, ())}}
    if not decode_into:
        out["decode buffer"] = torch.empty(0, dtype=wire).element_size() / per_node
    if wire == torch.float16:
        out["decode accumulator"] = 4.0 / per_node
    return {name: b for name, b in out.items() if b}


__all__ = ["COMPONENTS", "budget", "component_of", "deepspeed_storages", "persistent_tensors"]
