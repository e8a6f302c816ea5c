"""A hook's state methods: what ``engine.save_checkpoint`` / ``load_checkpoint`` call on ``engine.dragonn``
(the rules are ``engine/state.py``'s, the files ``engine/checkpoint.py``'s). A mixin of
:class:`~ds_dragonn.engine.base.HookBase`.
"""
from __future__ import annotations

from typing import List, Optional

from ..pipeline import CompressedAllreduce
from . import state


class HookState:
    """The state methods of :class:`~ds_dragonn.engine.base.HookBase` (module docstring)."""

    @property
    def pipelines(self) -> List[CompressedAllreduce]:
        """The pipelines built so far, one per data-parallel group, in creation order."""
        return list(self._pipelines.values())

    def residual_stores(self) -> list:
        """This hook's stores of unsent gradients (or momenta): its error feedback, and its momentum where it has one
        (:data:`~ds_dragonn.engine.state.RESIDUALS`)."""
        return list(state.stores(self, state.RESIDUALS).values())

    def where(self) -> tuple:
        """(rank, world size) of this hook's data-parallel group."""
        backend = next(iter(self._pipelines.values())).backend if self._pipelines else None
        if backend is not None:
            return backend.rank, backend.world_size
        import torch.distributed as dist  # before the first reduction (a save at step 0): DeepSpeed's group
        if dist.is_available() and dist.is_initialized():
            group = getattr(self.engine, "data_parallel_group", None)
            return dist.get_rank(group=group), dist.get_world_size(group=group)
        return 0, 1

    def state_dict(self) -> dict:
        """This rank's DRAGONN state: residuals (the partitioned exchange's server residuals too), the
        buckets that may hold unsent gradient, telemetry totals, and the description of the run they belong
        to (:func:`ds_dragonn.engine.state.describe`). Each rank holds its own: ``engine.save_checkpoint``
        writes one file per rank (``engine/checkpoint.py``)."""
        return state.state_dict(self)

    def extra_state(self) -> dict:
        """Parts of this rank's state that only some hooks have (merged into :meth:`state_dict`)."""
        return {}

    def load_extra_state(self, saved: dict) -> None:
        """Restore :meth:`extra_state` from a saved state that applies here (after the residuals)."""

    def reset_extra_state(self) -> None:
        """:meth:`extra_state` starts afresh (a state that does not apply here, or a warm start)."""

    def restore_after_reset(self, saved: dict, reasons: List[str]) -> None:
        """A saved state was reset for ``reasons`` (``engine/state.py``): take from it what still applies."""

    def after_load(self, saved_worlds: List[Optional[int]]) -> None:
        """After every rank applied its state file (collective, on every rank): ``saved_worlds`` is each
        rank's saved world size (None: no file)."""

    def reset_state(self, why: str) -> None:
        """Start with empty residuals (and no pending flush), with a warning saying why."""
        state.reset_state(self, why)

    def load_state_dict(self, saved: dict, source: str = "the state") -> None:
        """Restore :meth:`state_dict` of this rank, by the rules of ``engine/state.py`` (reset, fold or keep, each
        logged). Any open step transaction is dropped and bucket ordinals count from 0 again.

        Raises:
            ValueError: ``saved`` is not a valid DRAGONN state (:func:`~ds_dragonn.engine.state.validate`), naming
                ``source`` and what is wrong.
        """
        state.load_state_dict(self, saved, source)
