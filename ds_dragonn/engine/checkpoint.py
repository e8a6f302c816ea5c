"""DRAGONN state in DeepSpeed's own checkpoints: one file per rank beside DeepSpeed's, in the tag folder.

``engine.save_checkpoint(save_dir, tag)`` and ``engine.load_checkpoint(load_dir, tag)`` are wrapped on the
engine *instance* (:func:`install`): every rank writes ``<save_dir>/<tag>/dragonn_rank<R>.pt`` before
DeepSpeed saves (whose last act is to point ``latest`` at the tag, after a barrier), and reads it after
DeepSpeed has loaded. No user code is needed, and nothing goes into ``client_state``,
which DeepSpeed saves from rank 0 only (every rank would then load rank 0's residuals).

A state file holds this rank's residuals (the partitioned exchange's server residuals too), the buckets
that may hold unsent gradient, the telemetry totals, and a description of the run it belongs to: world
size, rank, global step, the ``"dragonn"`` block, DeepSpeed's bucketing settings and the trainable
parameters' names and shapes. The per-step hash seeds derive from ``dragonn.seed`` and DeepSpeed's
``global_steps``, which DeepSpeed restores itself, so a resumed run is the uninterrupted run bit for bit.

Rules when the run differs from the saved one (:func:`compare`; every case logs a warning that names what
differs, none is silent):

* another world size or rank, other trainable parameters (names or shapes), another ZeRO stage, bucket
  size or communication dtype: the residuals belong to other buckets or other ranks' gradients; another
  ``gradient_predivide_factor`` or ``prescale_gradients``: they are in other units. They are **reset**
  (start empty);
* another exchange scheme: the partitioned exchange's server residuals are **folded** into this rank's
  worker residuals at the indices it owned (exact: the same unsent sum goes out with the next
  compressed reduction);
* another density, compressor, kernel, sample size, warm-up or policy: the residuals are unsent gradients
  in the same units whatever those settings, so they are **kept**.

After every load the ranks compare their global step (:func:`check_same_step`): ranks that resumed
different tags fail at once instead of hanging later.

Save and load are collective, like the config agreement: a rank that cannot write or read its state file
makes every rank raise :class:`CheckpointError`, naming each failing rank and its file (:func:`agree`). A
failed save leaves no trace: every rank writes ``dragonn_rank<R>.pt.tmp`` first, and the files are renamed
to their final names only once every rank has written its own; otherwise the temporary files are removed,
DeepSpeed's save is not run (``latest`` stays where it was), and a tag folder left empty is removed. A
load where one rank's file is missing while the other ranks hold theirs, saved at this world size, is an
incomplete checkpoint and fails the same way.

Loading with ``load_optimizer_states=False`` or ``load_module_only=True`` (a warm start) leaves the
residuals empty, like DeepSpeed's optimizer state.
"""
from __future__ import annotations

import hashlib
import inspect
import os
from typing import Any, Dict, List, Optional, Tuple

import torch

#: Version of the state file layout (refused when newer than this code).
FORMAT = 1

#: Settings of the "dragonn" block whose difference keeps the residuals (they are unsent gradients in the same
#: units whatever these say); the difference is logged.
_KEPT_FIELDS = ("density", "compressor", "kernel", "sample_ratio", "min_sample", "table_factor", "warmup_steps",
                "policy", "auto_probe_steps", "auto_recheck_interval", "min_compress_numel", "seed",
                "density_warmup_steps", "density_warmup_start", "selection", "tensor_min_compress_numel",
                "compress_1d", "freeze_adam_variance")


class CheckpointMismatchError(ValueError):
    """Ranks resumed from different checkpoints (different global steps): raised on every rank."""


class CheckpointError(ValueError):
    """A rank could not write or read its DRAGONN state file: raised on every rank, naming the failing ranks
    and their files."""


def agree(hook: Any, error: Optional[BaseException], what: str) -> None:
    """One ``all_gather_object`` over the data-parallel group: every rank learns which ranks failed ``what``.

    Raises:
        CheckpointError: on every rank when any rank passed an ``error`` (chained to it on that rank),
            naming each failing rank and its message (in a single process, for its own error).
    """
    everyone, rank = gather(hook, _message(error))
    _raise_failures(everyone, rank, what, error)


def _message(error: Optional[BaseException]) -> Optional[str]:
    return None if error is None else f"{type(error).__name__}: {error}"


def _raise_failures(messages: List[Optional[str]], rank: int, what: str, error: Optional[BaseException]) -> None:
    """Raise :class:`CheckpointError` naming every rank whose message is not None (see :func:`agree`)."""
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    if failed:
        detail = "; ".join(f"rank {r}: {m}" for r, m in failed)
        raise CheckpointError(f"[rank {rank}] DRAGONN {what} failed on {len(failed)} of {len(messages)} ranks, so "
                              f"every rank stops ({detail})") from error


def gather(hook: Any, value: Any) -> Tuple[list, int]:
    """``(every rank's value, this rank)`` over the engine's data-parallel group (``all_gather_object``;
    ``([value], 0)`` without a process group)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return [value], 0
    group = getattr(hook.engine, "data_parallel_group", None)
    everyone: list = [None] * dist.get_world_size(group=group)
    dist.all_gather_object(everyone, value, group=group)
    return everyone, dist.get_rank(group=group)


def check_same_step(hook: Any, tag: str = "") -> None:
    """One small allgather of ``(global_steps, digest of the loaded tag)`` over the data-parallel group after
    a load: ranks that resumed different tags would otherwise take different dense/compressed branches
    (warm-up, seeds) or hold residuals of different steps, or hang.

    Raises:
        CheckpointMismatchError: on every rank, naming each rank's step and tag.
    """
    if not hook._pipelines:
        return
    backend = next(iter(hook._pipelines.values())).backend
    if backend.world_size <= 1:
        return
    device = getattr(hook.engine, "device", None) or torch.device("cpu")
    code = int.from_bytes(hashlib.blake2b(tag.encode(), digest_size=7).digest(), "little")
    rows = backend.all_gather_ints([int(hook.engine.global_steps), code], device)
    if len({tuple(r) for r in rows}) > 1:
        per_rank = ", ".join(f"rank {r}: {row[0]}" for r, row in enumerate(rows))
        what = "global steps" if len({r[0] for r in rows}) > 1 else "tags at the same step"
        raise CheckpointMismatchError(f"[rank {backend.rank}] ranks resumed different checkpoint {what} (global "
                                      f"step {per_rank}; this rank's tag {tag!r}); every rank must load the "
                                      f"same checkpoint tag")


def state_path(folder: str, rank: int) -> str:
    """This rank's DRAGONN state file in a checkpoint's tag folder."""
    return os.path.join(folder, f"dragonn_rank{rank}.pt")


def describe(hook: Any) -> Dict[str, Any]:
    """What the hook's residuals belong to: rank, world size, step, settings, bucketing, parameters."""
    engine = hook.engine
    rank, world = hook._where()
    params = [(name, tuple(p.shape)) for name, p in engine.module.named_parameters() if p.requires_grad]
    zero = engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else 0
    comm = getattr(engine, "communication_data_type", None)
    bucketing = {"zero_optimization.stage": int(zero),
                 "communication_data_type": str(comm).replace("torch.", "") if comm is not None else None}
    if hasattr(engine, "zero_reduce_bucket_size"):
        bucketing["zero_optimization.reduce_bucket_size"] = int(engine.zero_reduce_bucket_size())
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
        if sb.get(field) != cb.get(field):
            reset.append(f"{field} {sb.get(field)} (now {cb.get(field)})")
    sp = [(n, tuple(s)) for n, s in saved.get("parameters", [])]
    cp = current["parameters"]
    if sp != cp:
        names_s, names_c = dict(sp), dict(cp)
        diff = [f"{n}: {names_s.get(n, 'absent')} (now {names_c.get(n, 'absent')})"
                for n in list(names_s) + [n for n in names_c if n not in names_s] if names_s.get(n) != names_c.get(n)]
        reset.append("trainable parameters " + ("; ".join(diff[:3]) + (" ..." if len(diff) > 3 else "")
                                                if diff else "in another order"))
    sd, cd = saved.get("dragonn", {}), current["dragonn"]
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


def _residual_dtype_of(key: Any) -> Any:
    """The residual dtype a bucket key implies (its wire dtype's ``residual_dtype``), or None if unknown."""
    from ..feedback import residual_dtype
    names = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}
    for part in key if isinstance(key, tuple) else ():
        if isinstance(part, str) and part in names:
            return residual_dtype(names[part])
    return None


def _numel_of(key: Any) -> Any:
    """The bucket length in a hook's key (stage 0: ``(ordinal, dtype, numel, layout)``; ZeRO: ``("zero",
    ordinal, dtype, numel, layout)``), or None for another key."""
    if isinstance(key, tuple) and len(key) == 4 and isinstance(key[2], int):
        return key[2]
    if isinstance(key, tuple) and len(key) == 5 and key[0] == "zero" and isinstance(key[3], int):
        return key[3]
    return None


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
    for key, buf in ef.get("residuals", {}).items():
        if not isinstance(buf, torch.Tensor) or buf.dim() != 1 or not buf.is_floating_point():
            raise bad(f"residual {key} is not a 1-D float tensor")
        numel, dtype = _numel_of(key), _residual_dtype_of(key)
        if numel is not None and buf.numel() != numel:
            raise bad(f"residual {key} has {buf.numel()} elements for a bucket of {numel}")
        if dtype is not None and buf.dtype != dtype:
            raise bad(f"residual {key} is {buf.dtype}, the bucket's residual dtype is {dtype}")
        if buf.numel() and not bool(torch.isfinite(buf).all()):
            raise bad(f"residual {key} holds NaN or Inf")


def _bound(method: Any, args: tuple, kwargs: dict) -> Dict[str, Any]:
    sig = inspect.signature(method)
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def install(hook: Any) -> None:
    """Wrap ``engine.save_checkpoint`` / ``load_checkpoint`` so they carry this rank's DRAGONN state."""
    engine = hook.engine
    save, load = engine.save_checkpoint, engine.load_checkpoint

    def save_checkpoint(*args, **kwargs):
        """This rank's DRAGONN state in the tag folder, then DeepSpeed's ``save_checkpoint``.

        Written first: DeepSpeed's save starts with a barrier and ends by pointing ``latest`` at the tag, so
        ``latest`` never names a tag whose DRAGONN files are still being written. Collective: if any rank
        cannot write its file, every rank raises :class:`CheckpointError` and nothing is left behind."""
        a = _bound(save, args, kwargs)
        tag = a.get("tag")
        tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"  # DeepSpeed's default
        if a.get("save_dir"):  # (DeepSpeed itself refuses an empty save_dir)
            _save_state(hook, os.path.join(a["save_dir"], tag))
        return save(*args, **kwargs)

    def load_checkpoint(*args, **kwargs):
        """DeepSpeed's ``load_checkpoint``, then this rank's DRAGONN state from the loaded tag folder.
        Collective: if any rank cannot read or apply its file, every rank raises :class:`CheckpointError`."""
        a = _bound(load, args, kwargs)
        out = load(*args, **kwargs)
        load_path = out[0] if isinstance(out, tuple) and out else None
        check_same_step(hook, os.path.basename(os.path.dirname(str(load_path))) if load_path else "")
        if load_path is None:
            return out  # DeepSpeed loaded nothing
        folder, error, read = os.path.dirname(str(load_path)), None, ("error", None, None)
        what = f"load_checkpoint from {folder}"
        try:
            read = _read_state(hook, a, folder)
        except Exception as err:  # noqa: BLE001 - every rank raises it, named, below
            error = err
        # one allgather: whether each rank read its file, and which world size saved it
        saved_world = read[1].get("world_size") if read[0] == "read" and isinstance(read[1], dict) else None
        everyone, rank = gather(hook, (_message(error), read[0], saved_world))
        _raise_failures([m for m, _, _ in everyone], rank, what, error)
        _raise_failures(_incomplete([(k, w) for _, k, w in everyone], folder, hook._where()[1]), rank, what, None)
        try:
            _apply_state(hook, read)
        except Exception as err:  # noqa: BLE001 - every rank raises it, named, in agree()
            error = err
        agree(hook, error, what)
        return out

    save_checkpoint.__wrapped__ = save
    load_checkpoint.__wrapped__ = load
    engine.save_checkpoint = save_checkpoint
    engine.load_checkpoint = load_checkpoint


def _save_state(hook: Any, folder: str) -> None:
    """Write this rank's state to ``<folder>/dragonn_rank<R>.pt`` on every rank, or on none (module docstring)."""
    rank, _ = hook._where()
    path = state_path(folder, rank)
    tmp, error = path + ".tmp", None
    try:
        os.makedirs(folder, exist_ok=True)
        if os.path.lexists(path) and not os.path.isfile(path):
            raise IsADirectoryError(f"{path} exists and is not a file")
        torch.save(hook.state_dict(), tmp)
    except Exception as err:  # noqa: BLE001 - every rank raises it, named, in agree()
        error = OSError(f"cannot write the state file {tmp}: {err}")
    try:
        agree(hook, error, f"save_checkpoint to {folder}")
    except CheckpointError:
        if os.path.isfile(tmp):
            os.remove(tmp)
        agree(hook, None, "the clean-up of a failed save")  # every rank's files are gone: now the folder
        if rank == 0:
            try:
                os.rmdir(folder)  # only if empty: a tag folder that held nothing before
            except OSError:
                pass
        raise
    error = None
    try:
        os.replace(tmp, path)  # never a half-written file under the final name
    except OSError as err:
        error = OSError(f"cannot rename {tmp} to {path}: {err}")
    agree(hook, error, f"save_checkpoint to {folder}")  # DeepSpeed's save runs only if every rank renamed


def _read_state(hook: Any, a: Dict[str, Any], folder: str) -> Tuple[str, Any, str]:
    """This rank's part of a load, after DeepSpeed's: ``("warm", None, why)`` for a warm start,
    ``("missing", None, path)``, or ``("read", state, path)``. Raises ValueError naming an unreadable file."""
    if not a.get("load_optimizer_states", True) or a.get("load_module_only", False):
        return "warm", None, (f"load_checkpoint(load_optimizer_states={a.get('load_optimizer_states')}, "
                              f"load_module_only={a.get('load_module_only')}): a warm start")
    rank, _ = hook._where()
    path = state_path(folder, rank)
    if not os.path.isfile(path):
        return "missing", None, path
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001 - re-raised with the file named
        raise ValueError(f"[rank {rank}] DRAGONN: cannot read the state file {path}: {err}") from err
    return "read", state, path


def _incomplete(found: List[Tuple[str, Any]], folder: str, world: int) -> List[Optional[str]]:
    """Per rank, the error of a rank whose state file is missing while another rank read one saved by this
    world size (an incomplete checkpoint; not a plain DeepSpeed one, nor one saved by another world size).
    ``found``: every rank's ``(kind, saved world size)`` from :func:`_read_state`."""
    if not any(k == "read" and w == world for k, w in found):
        return [None] * len(found)
    return [_message(FileNotFoundError(f"{state_path(folder, r)} is missing while the other ranks' files of this "
                                       f"{world}-rank checkpoint are there (an incomplete or damaged checkpoint)"))
            if k == "missing" else None for r, (k, _) in enumerate(found)]


def _apply_state(hook: Any, read: Tuple[str, Any, str]) -> None:
    """Apply what :func:`_read_state` found: reset for a warm start or a missing file, else load."""
    kind, state, path = read
    if hook.variance_freeze is not None:  # the optimizer's state tensors were replaced: snapshot them anew
        hook.variance_freeze.reset()
    if kind == "warm":
        hook.reset_state(path)
    elif kind == "missing":
        hook.reset_state(f"{path} not found (a checkpoint saved without ds_dragonn, or by fewer ranks)")
    else:
        hook.load_state_dict(state, source=path)
