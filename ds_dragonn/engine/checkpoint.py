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
  size or communication dtype: the residuals belong to other buckets or other ranks' gradients, so they
  are **reset** (start empty);
* another exchange scheme: the partitioned exchange's server residuals are **folded** into this rank's
  worker residuals at the indices it owned (exact: the same unsent sum goes out with the next
  compressed reduction);
* another density, compressor, kernel, sample size, warm-up or policy: the residuals are unsent gradients
  in the same units whatever those settings, so they are **kept**.

After every load the ranks compare their global step (:func:`check_same_step`): ranks that resumed
different tags fail at once instead of hanging later. Loading with ``load_optimizer_states=False`` or ``load_module_only=True`` (a warm start) leaves the
residuals empty, like DeepSpeed's optimizer state.
"""
from __future__ import annotations

import inspect
import os
from typing import Any, Dict, List, Tuple

import torch

#: Version of the state file layout (refused when newer than this code).
FORMAT = 1

#: Settings of the "dragonn" block whose difference resets nothing (the residuals are unsent gradients
#: in the same units), and those that change what the residuals mean.
_KEPT_FIELDS = ("density", "compressor", "kernel", "sample_ratio", "min_sample", "table_factor", "warmup_steps",
                "policy", "auto_probe_steps", "auto_recheck_interval", "min_compress_numel", "seed", "log_interval")


class CheckpointMismatchError(ValueError):
    """Ranks resumed from different checkpoints (different global steps): raised on every rank."""


def check_same_step(hook: Any) -> None:
    """One small allgather of ``global_steps`` over the data-parallel group after a load: ranks that resumed
    different tags would otherwise take different dense/compressed branches (warm-up, seeds) and hang.

    Raises:
        CheckpointMismatchError: on every rank, naming each rank's step.
    """
    if not hook._pipelines:
        return
    backend = next(iter(hook._pipelines.values())).backend
    if backend.world_size <= 1:
        return
    device = getattr(hook.engine, "device", None) or torch.device("cpu")
    steps = [row[0] for row in backend.all_gather_ints([int(hook.engine.global_steps)], device)]
    if len(set(steps)) > 1:
        per_rank = ", ".join(f"rank {r}: {s}" for r, s in enumerate(steps))
        raise CheckpointMismatchError(f"[rank {backend.rank}] ranks resumed at different global steps ({per_rank}); "
                                      f"every rank must load the same checkpoint tag")


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
    return {"format": FORMAT, "rank": rank, "world_size": world, "global_steps": int(engine.global_steps),
            "dragonn": hook.cfg.model_dump(mode="json"), "bucketing": bucketing, "parameters": params}


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
    if sd.get("exchange") != cd["exchange"]:
        fold.append(f"dragonn.exchange {sd.get('exchange')} (now {cd['exchange']})")
    for field in _KEPT_FIELDS:
        if field in sd and sd.get(field) != cd.get(field) and field != "log_interval":
            kept.append(f"dragonn.{field} {sd.get(field)} (now {cd.get(field)})")
    return reset, fold, kept


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
        ``latest`` never names a tag whose DRAGONN files are still being written."""
        a = _bound(save, args, kwargs)
        tag = a.get("tag")
        tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"  # DeepSpeed's default
        if a.get("save_dir"):  # (DeepSpeed itself refuses an empty save_dir)
            folder = os.path.join(a["save_dir"], tag)
            os.makedirs(folder, exist_ok=True)
            state = hook.state_dict()
            path = state_path(folder, state["description"]["rank"])
            torch.save(state, path + ".tmp")
            os.replace(path + ".tmp", path)  # never a half-written file under the final name
        return save(*args, **kwargs)

    def load_checkpoint(*args, **kwargs):
        """DeepSpeed's ``load_checkpoint``, then this rank's DRAGONN state from the loaded tag folder."""
        a = _bound(load, args, kwargs)
        out = load(*args, **kwargs)
        check_same_step(hook)
        load_path = out[0] if isinstance(out, tuple) and out else None
        if load_path is None:
            return out  # DeepSpeed loaded nothing
        rank, _ = hook._where()
        if not a.get("load_optimizer_states", True) or a.get("load_module_only", False):
            hook.reset_state(f"load_checkpoint(load_optimizer_states={a.get('load_optimizer_states')}, "
                             f"load_module_only={a.get('load_module_only')}): a warm start")
            return out
        path = state_path(os.path.dirname(str(load_path)), rank)
        if not os.path.isfile(path):
            hook.reset_state(f"{path} not found (a checkpoint saved without ds_dragonn, or by fewer ranks)")
            return out
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as err:  # noqa: BLE001 - re-raised with the file named
            raise ValueError(f"[rank {rank}] DRAGONN: cannot read the state file {path}: {err}") from err
        hook.load_state_dict(state, source=path)
        return out

    save_checkpoint.__wrapped__ = save
    load_checkpoint.__wrapped__ = load
    engine.save_checkpoint = save_checkpoint
    engine.load_checkpoint = load_checkpoint
