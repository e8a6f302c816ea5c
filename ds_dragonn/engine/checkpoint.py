"""DRAGONN state in DeepSpeed's own checkpoints: one file per rank beside DeepSpeed's, in the tag folder.

``engine.save_checkpoint`` / ``load_checkpoint`` are wrapped on the engine *instance* (:func:`install`): every
rank writes ``<save_dir>/<tag>/dragonn_rank<R>.pt`` before DeepSpeed saves, and reads it after DeepSpeed has
loaded (never through ``client_state``, which only rank 0 saves). Contents and load rules: ``engine/state.py``.
Save and load are collective (:func:`agree`, :class:`CheckpointError`); after every load the ranks compare their
global step (:func:`check_same_step`). A warm start (``load_optimizer_states=False`` / ``load_module_only=True``)
leaves the residuals empty. See docs/design.md, 'Around the step' (Checkpoints).
"""
from __future__ import annotations

import hashlib
import inspect
import os
from typing import Any, Dict, List, Optional, Tuple

import torch


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
    a load: ranks that resumed different tags would otherwise diverge or hang.

    Raises:
        CheckpointMismatchError: on every rank, naming each rank's step and tag.
    """
    if not hook.pipelines:
        return
    backend = hook.pipelines[0].backend
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

        Written first: DeepSpeed's save ends by pointing ``latest`` at the tag. Collective: if any rank cannot
        write its file, every rank raises :class:`CheckpointError` and nothing is left behind."""
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
        # and the online warm-up decision ("warmup_steps": "auto"), so that a rank without a file takes the others'
        warm = read[1].get("warmup") if read[0] == "read" and isinstance(read[1], dict) else None
        everyone, rank = gather(hook, (_message(error), read[0], saved_world, warm))
        _raise_failures([m for m, *_ in everyone], rank, what, error)
        _raise_failures(_incomplete([(k, w) for _, k, w, _ in everyone], folder, hook.where()[1]), rank, what, None)
        try:
            _apply_state(hook, read)
            hook.load_warmup_state(next((w for *_, w in everyone if isinstance(w, dict)), None))  # the same on all
        except Exception as err:  # noqa: BLE001 - every rank raises it, named, in agree()
            error = err
        agree(hook, error, what)
        hook.after_load([w for _, _, w, _ in everyone])
        return out

    save_checkpoint.__wrapped__ = save
    load_checkpoint.__wrapped__ = load
    engine.save_checkpoint = save_checkpoint
    engine.load_checkpoint = load_checkpoint


def _save_state(hook: Any, folder: str) -> None:
    """Write this rank's state to ``<folder>/dragonn_rank<R>.pt`` on every rank, or on none (module docstring)."""
    rank, _ = hook.where()
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
    rank, _ = hook.where()
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
