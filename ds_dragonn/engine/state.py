"""What a hook's state is: its contents, the description of the run it belongs to, and the rules for
loading it into another run (reset, fold or keep), with its validation. Files and collectives are
``engine/checkpoint.py``'s.

A state holds this rank's residuals (server residuals too), the buckets that may hold unsent gradient, the
telemetry totals, and a description of the run (world size, rank, step, the ``"dragonn"`` block, bucketing,
trainable parameters). When the run differs from the saved one (:func:`compare`) the residuals are **reset**,
**folded** or **kept**, each with a warning naming what differs: see docs/design.md, 'Around the step'
(Checkpoints). Another ``compress`` or ``sync`` mode also resets them: they would hold unsent momenta (or
pseudo-gradients) where gradients are expected. Where they are reset, the hook may still take what applies
(:meth:`HookBase.restore_after_reset`).
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Any, Dict, List, Tuple

import torch
from deepspeed.utils import logger

from ..exchange.ownership import HashedOwnership
from ..feedback import residual_dtype
from .bucket import DENSE, BucketKey

#: Version of the state file layout (refused when newer than this code).
FORMAT = 1

#: Settings of the "dragonn" block whose difference keeps the residuals (they are unsent gradients in the same
#: units whatever these say); the difference is logged.
_KEPT_FIELDS = ("density", "kernel", "warmup_steps", "policy", "min_compress_numel",
                "density_warmup_steps", "density_warmup_start", "variance_refresh_steps", "local_steps", "outer_lr",
                "values", "selection", "dense_values", "max_age")

#: Settings of the "dragonn" block whose difference resets the residuals, with the value a state saved before the
#: setting existed holds: under ``sync`` other than every step they hold pseudo-gradients, not gradients.
_RESET_FIELDS = {"sync": "every_step"}

#: what the residuals hold in each ``compress`` mode (as resolved at start-up)
_HELD = {"gradient": "unsent gradients", "momentum": "unsent Adam momenta"}

#: how a bucketing entry absent from a description reads (a flat run describes no node layout)
_ABSENT = {"hierarchy": "flat"}

#: The hook's stores a state holds beside the exchanges: the state's part -> the hook's attribute (None where the
#: hook has none: the part then holds None). Each store has ``state_dict()``; those of :data:`RESIDUALS` have
#: ``reset()``, those loaded with the residuals ``load_state_dict(saved, device)``.
STORES = {"error_feedback": "error_feedback", "momentum": "momentum", "variance": "variance_freeze",
          "warmup": "warmup_tracker"}

#: The parts holding unsent gradients (or momenta), each a dict of bucket key -> (n,) tensor in its named field:
#: emptied where a state does not apply.
RESIDUALS = {"error_feedback": ("residuals", "residual"), "momentum": ("momenta", "momentum")}

#: The parts loaded where a state applies (the frozen variance the saved momenta were divided by with them); the
#: warm-up tracker's is the steps', loaded whatever the residuals (``HookBase.load_warmup_state``).
_LOADED = ("error_feedback", "momentum", "variance")


def stores(hook: Any, parts: Any = STORES) -> Dict[str, Any]:
    """The hook's stores among ``parts`` (of :data:`STORES`), by part; those it does not have are left out."""
    held = {part: getattr(hook, STORES[part], None) for part in parts}
    return {part: store for part, store in held.items() if store is not None}


def describe(hook: Any) -> Dict[str, Any]:
    """What the hook's residuals belong to: rank, world size, step, settings, bucketing, parameters."""
    engine = hook.engine
    rank, world = hook.where()
    # ZeRO-3 partitions a parameter's storage (its .shape then reads (0,) or the gathered shape): ds_shape is the full one
    params = [(name, tuple(getattr(p, "ds_shape", p.shape))) for name, p in engine.module.named_parameters()
              if p.requires_grad]
    zero = engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else 0
    comm = getattr(engine, "communication_data_type", None)
    bucketing = {"zero_optimization.stage": int(zero),
                 "communication_data_type": str(comm).replace("torch.", "") if comm is not None else None}
    if hasattr(engine, "zero_reduce_bucket_size"):
        bucketing["zero_optimization.reduce_bucket_size"] = int(engine.zero_reduce_bucket_size())
    if getattr(hook, "layout", None) is not None:  # node-aware: the residuals are shards of this layout's node sums
        bucketing["hierarchy"] = str(hook.layout)
    # the residuals are in units of the prescaled gradients: DeepSpeed's averaging settings fix that scale
    for name in ("gradient_predivide_factor", "postscale_gradients"):
        if hasattr(engine, name):
            bucketing[name] = getattr(engine, name)()
    return {"format": FORMAT, "rank": rank, "world_size": world, "global_steps": int(engine.global_steps),
            "dragonn": hook.cfg.model_dump(mode="json"), "exchange": hook.exchange_name, "bucketing": bucketing,
            "parameters": params}


def compare(saved: Dict[str, Any], current: Dict[str, Any]) -> Tuple[List[str], List[str], List[str]]:
    """(reset reasons, fold reasons, kept differences) between a saved description and this run's.

    Any reset reason means the residuals cannot apply here; fold reasons mean the server residuals go into
    the worker residuals; kept differences are logged only.
    """
    reset, fold, kept = [], [], []
    for field in ("world_size", "rank"):
        if saved.get(field) != current[field]:
            reset.append(f"{field.replace('_', ' ')} {saved.get(field)} (now {current[field]})")
    sb, cb = saved.get("bucketing", {}), current["bucketing"]
    for field in sorted(set(sb) | set(cb)):
        was, now = sb.get(field, _ABSENT.get(field)), cb.get(field, _ABSENT.get(field))
        if was != now:
            reset.append(f"{field} {was} (now {now})")
    sp = [(n, tuple(s)) for n, s in saved.get("parameters", [])]
    cp = current["parameters"]
    if sp != cp:
        names_s, names_c = dict(sp), dict(cp)
        diff = [f"{n}: {names_s.get(n, 'absent')} (now {names_c.get(n, 'absent')})"
                for n in list(names_s) + [n for n in names_c if n not in names_s] if names_s.get(n) != names_c.get(n)]
        reset.append("trainable parameters " + ("; ".join(diff[:3]) + (" ..." if len(diff) > 3 else "")
                                                if diff else "in another order"))
    sd, cd = saved.get("dragonn", {}), current["dragonn"]
    for field, default in _RESET_FIELDS.items():
        if sd.get(field, default) != cd.get(field, default):
            reset.append(f"dragonn.{field} {sd.get(field, default)} (now {cd.get(field, default)})")
    ms, mc = sd.get("compress"), cd.get("compress")
    if ms != mc and ms in _HELD and mc in _HELD:
        reset.append(f"dragonn.compress {ms} (now {mc}): the residuals hold {_HELD[ms]}, which this mode would "
                     f"apply as {_HELD[mc]}")
    if sd.get("error_feedback", True) != cd["error_feedback"] and not cd["error_feedback"]:
        reset.append("error_feedback off now")
    ran, runs = saved.get("exchange", sd.get("exchange")), current["exchange"]  # the scheme the hook ran
    if ran != runs and ran == "partitioned":  # only the partitioned exchange holds server residuals
        fold.append(f"exchange partitioned (now {runs})")
    elif sd.get("exchange") != cd["exchange"]:
        kept.append(f"dragonn.exchange {sd.get('exchange')} (now {cd['exchange']})")
    for field in _KEPT_FIELDS:
        if field in sd and sd.get(field) != cd.get(field):
            kept.append(f"dragonn.{field} {sd.get(field)} (now {cd.get(field)})")
    return reset, fold, kept


def validate(state: Any, where: str) -> None:
    """Check the structure of a DRAGONN state before anything of it is used.

    Raises:
        ValueError: naming ``where`` (rank and source) and what is wrong: not a dict; no or a malformed
            ``error_feedback``; a newer ``format``; a malformed description, exchange list or pending list;
            a residual that is not a 1-D floating-point tensor, holds NaN/Inf (a residual never does), or
            does not have its bucket's length or residual dtype.
    """
    def bad(what: str) -> ValueError:
        return ValueError(f"{where} is not a valid DRAGONN state: {what}")

    if not isinstance(state, dict):
        raise bad(f"a {type(state).__name__}, not a dict")
    ef = state.get("error_feedback")
    if not isinstance(ef, dict) or not isinstance(ef.get("residuals", {}), dict):
        raise bad("no 'error_feedback' dict with a 'residuals' dict")
    desc = state.get("description")
    if desc is not None:
        if not isinstance(desc, dict):
            raise bad("'description' is not a dict")
        fmt = desc.get("format", FORMAT)
        if not isinstance(fmt, int):
            raise bad(f"'description.format' is {fmt!r}, not an int")
        if fmt > FORMAT:
            raise ValueError(f"{where} has format {fmt}, newer than this ds_dragonn's {FORMAT}")
        if not isinstance(desc.get("parameters", []), list) or not isinstance(desc.get("bucketing", {}), dict) \
                or not isinstance(desc.get("dragonn", {}), dict):
            raise bad("'description' has malformed 'parameters', 'bucketing' or 'dragonn'")
    for part in ("exchange", "pending"):
        if not isinstance(state.get(part, []), (list, tuple)):
            raise bad(f"'{part}' is not a list")
    if not all(isinstance(x, dict) for x in state.get("exchange", [])):
        raise bad("'exchange' holds something other than dicts")
    if not isinstance(state.get("telemetry", {}), dict):
        raise bad("'telemetry' is not a dict")
    for part, (field, what) in RESIDUALS.items():  # (the error feedback's is there: checked above)
        held = state.get(part)
        if held is not None and (not isinstance(held, dict) or not isinstance(held.get(field, {}), dict)):
            raise bad(f"'{part}' is not a dict with a '{field}' dict")
        _check_buffers(bad, what, (held or {}).get(field, {}))


def _check_buffers(bad: Any, what: str, buffers: dict) -> None:
    """Each of ``buffers`` (bucket key -> tensor) is a finite 1-D float tensor of its bucket's length and
    residual dtype; else ``raise bad(...)`` naming ``what`` and the key."""
    for key, buf in buffers.items():
        if not isinstance(buf, torch.Tensor) or buf.dim() != 1 or not buf.is_floating_point():
            raise bad(f"{what} {key} is not a 1-D float tensor")
        bucket = BucketKey.parse(key)
        numel = bucket.numel if bucket is not None else None
        dtype = residual_dtype(bucket.torch_dtype) if bucket is not None and bucket.torch_dtype is not None else None
        if numel is not None and buf.numel() != numel:
            raise bad(f"{what} {key} has {buf.numel()} elements for a bucket of {numel}")
        if dtype is not None and buf.dtype != dtype:
            raise bad(f"{what} {key} is {buf.dtype}, the bucket's residual dtype is {dtype}")
        if buf.numel() and not bool(torch.isfinite(buf).all()):
            raise bad(f"{what} {key} holds NaN or Inf")


def saved_count(value: Any, default: Any = 0) -> Any:
    """``value`` where a state file holds a count there (an int >= 0, not a bool), else ``default``: a malformed or
    missing entry starts afresh instead of failing the load."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else default


def state_dict(hook: Any) -> dict:
    """This rank's DRAGONN state (module docstring): what ``engine.save_checkpoint`` writes per rank."""
    hook.settle()
    desc = describe(hook)
    return {"description": desc, "rank": desc["rank"], "world_size": desc["world_size"],
            **dict.fromkeys(STORES), **{part: store.state_dict() for part, store in stores(hook).items()},
            "exchange": [p.exchange.state_dict() for p in hook.pipelines],
            "pending": [tuple(k) if isinstance(k, tuple) else k for k in hook.pending],
            "telemetry": asdict(hook.telemetry), "loss_scale_units": hook.steps.units,
            "age_skipped": hook.steps.skipped_ticks, **hook.extra_state()}


def reset_state(hook: Any, why: str) -> None:
    """Empty residuals (and no pending flush), with a warning saying why."""
    rank, _ = hook.where()
    note(hook, f"[rank {rank}] DRAGONN: residuals start empty: {why}")
    for store in stores(hook, RESIDUALS).values():
        store.reset()
    for pipe in hook.pipelines:
        pipe.exchange.reset()
    hook.pending.clear()
    hook.forget_round()
    hook.steps.skipped_ticks = 0  # the age clock: with empty residuals any block order is exact, and 0 agrees
    hook.reset_extra_state()


def load_state_dict(hook: Any, state: dict, source: str = "the state") -> None:
    """Restore :func:`state_dict` of this rank by the rules above (see ``HookBase.load_state_dict``).

    Raises:
        ValueError: ``state`` is not a valid DRAGONN state (:func:`validate`), naming ``source``.
    """
    rank, world = hook.where()
    validate(state, f"[rank {rank}] DRAGONN: {source}")
    hook.load_warmup_state(state.get("warmup"))  # where the dense warm-up ended: the steps', not the residuals'
    saved = state.get("description") or {"rank": state.get("rank"), "world_size": state.get("world_size")}
    current = describe(hook)
    if "description" in state:
        reset, fold, kept = compare(saved, current)
    else:  # a bare state (rank and world size only)
        reset = [] if (saved["rank"], saved["world_size"]) == (rank, world) else \
            [f"saved by rank {saved['rank']} of {saved['world_size']} not loaded into rank {rank} of {world}"]
        fold, kept = [], []
    if reset:
        reset_state(hook, f"{source} does not apply here: " + "; ".join(reset))
        hook.restore_after_reset(state, reset)
        return
    hook.forget_round()
    hook.steps.skipped_ticks = saved_count(state.get("age_skipped"))  # the age clock's, with the residuals it follows
    device = getattr(hook.engine, "device", None)
    parts = {part: _rekey(state.get(part)) for part in _LOADED}  # (a part saved as None: the store starts afresh)
    residuals = parts["error_feedback"].setdefault("residuals", {})
    if getattr(hook, "dense_codec", False) is None:  # stage 0, its dense steps DeepSpeed's allreduce now
        rounding = [k for k in residuals if isinstance(k, BucketKey) and k.hook == DENSE]
        for k in rounding:
            residuals.pop(k)
        if rounding:
            note(hook, f"[rank {rank}] DRAGONN: {source} holds the rounding of quantized dense steps "
                       f"('advanced.dense_values'), whose steps now go through DeepSpeed's allreduce: dropped "
                       f"({len(rounding)} buffer(s), at most half a quantization step per value)")
    for part, store in stores(hook, _LOADED).items():
        store.load_state_dict(parts[part], device)
    exchanges = [_rekey(ex) for ex in state.get("exchange", [])]
    pipes = hook.pipelines
    for pipe in pipes:
        pipe.exchange.reset()
    if fold:
        fold_server_residuals(hook, exchanges)
        note(hook, f"[rank {rank}] DRAGONN: {'; '.join(fold)}: this rank's server residuals from {source} "
                   f"were added into its worker residuals (exact: the same unsent sum)")
    elif exchanges and len(exchanges) == len(pipes):
        for pipe, ex_state in zip(pipes, exchanges):
            pipe.exchange.load_state_dict(ex_state, device)
    hook.load_extra_state(state)
    hook.pending.clear()
    hook.pending.update({_key(k) for k in state.get("pending") or ()} | set(residuals))
    # the fp16 loss scale the residuals are in (rescaled at the next reduction if the scale differs)
    hook.steps.units = state.get("loss_scale_units")
    for field, value in (state.get("telemetry") or {}).items():
        if hasattr(hook.telemetry, field) and isinstance(value, (int, float)):
            setattr(hook.telemetry, field, value)
    if kept:
        held = _HELD.get(current["dragonn"].get("compress"), _HELD["gradient"])
        note(hook, f"[rank {rank}] DRAGONN: {source} was saved with {'; '.join(kept)}; its residuals are "
                   f"kept ({held}, in the same units whatever these settings)")


def fold_server_residuals(hook: Any, exchanges: list) -> None:
    """Add saved partitioned-exchange server residuals into the worker residuals of the same buckets, at
    the indices this rank owned (node-aware: of its cross-node group)."""
    rank, world = hook.where()
    pipes = hook.pipelines
    cross = getattr(pipes[0], "cross", None) if pipes else None
    if cross is not None:  # (the layout is in the description: a saved one of another layout was reset)
        rank, world = cross.backend.rank, cross.backend.world_size
    residuals = hook.error_feedback.residuals
    for ex_state in exchanges:
        numels = ex_state.get("numel", {})
        for key, part in ex_state.get("server", {}).get("residuals", {}).items():
            if key not in numels or not part.numel():
                continue
            own = HashedOwnership(numels[key], world)
            worker = residuals.get(key)
            if worker is None:
                device = getattr(hook.engine, "device", None) or part.device
                worker = residuals[key] = torch.zeros(numels[key], dtype=part.dtype, device=device)
            idx = own.to_index(rank, torch.arange(part.numel(), device=worker.device))
            worker.index_add_(0, idx, part.to(worker))


def note(hook: Any, message: str) -> None:
    """Record ``message`` in ``hook.notes`` and log it as a warning."""
    hook.notes.append(message)
    logger.warning(message)


def _key(key: Any) -> Any:
    """A saved bucket key as this version's :class:`BucketKey` (earlier versions saved plain tuples)."""
    parsed = BucketKey.parse(key)
    return parsed if parsed is not None else key


def _rekey(saved: Any) -> Any:
    """A saved part with the bucket keys of its dicts, at every depth, read by :func:`_key` (other keys never parse)."""
    return {_key(k): _rekey(v) for k, v in saved.items()} if isinstance(saved, dict) else saved


__all__ = ["FORMAT", "RESIDUALS", "STORES", "compare", "describe", "fold_server_residuals", "load_state_dict",
           "reset_state", "saved_count", "state_dict", "stores", "validate"]
