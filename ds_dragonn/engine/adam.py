"""Adam's variance frozen once compression is at its target density (1-bit Adam's remedy, Tang et al., ICML 2021).

Error feedback keeps what was not sent and delivers it later, in a burst: an element that waits 100 steps
arrives with ~100 steps of gradient at once. SGD applies the sum linearly, so nothing is lost. Adam does
not: it divides the burst by ``sqrt(v)``, and ``v`` grows with the burst's square, so the element moves
about one learning rate once instead of a hundred times; exact top-k loses as much as DRAGONN (issue 8).
1-bit Adam makes Adam linear again by freezing the second moment ``v`` after a warm-up: the update is
then momentum SGD with a fixed per-element preconditioner, and error feedback works as for SGD. DGC's
momentum correction solves the same problem for SGD momentum (Lin et al., ICLR 2018).

:class:`VarianceFreeze` registers a post-step hook on the engine's innermost ``torch.optim.Optimizer``
(torch Adam/AdamW, DeepSpeed's FusedAdam/CPUAdam: any optimizer whose state holds ``exp_avg_sq``): at the
first optimizer step at or after ``freeze_step`` it copies every ``exp_avg_sq``, and after every later
step writes that copy back (one pass over the variance; the optimizer itself makes about ten). A skipped
step (fp16 overflow) runs no optimizer step and no hook.
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch
from deepspeed.utils.logging import print_dist


def base_optimizer(engine: Any) -> Optional[torch.optim.Optimizer]:
    """The innermost ``torch.optim.Optimizer`` of a DeepSpeed engine (through BF16/FP16/ZeRO wrappers)."""
    opt, seen = getattr(engine, "optimizer", None), 0
    while opt is not None and seen < 8:
        inner = getattr(opt, "optimizer", None)
        if isinstance(opt, torch.optim.Optimizer) and not isinstance(inner, torch.optim.Optimizer):
            return opt
        opt, seen = inner, seen + 1
    return None


class VarianceFreeze:
    """Freeze Adam's ``exp_avg_sq`` from the optimizer step that ends at global step ``freeze_step``.

    Args:
        engine: the DeepSpeed engine (its ``global_steps`` counts the steps taken before the current one).
        freeze_step: the first global step whose update uses the frozen variance is ``freeze_step + 1``.
    """

    def __init__(self, engine: Any, freeze_step: int):
        self.engine = engine
        self.freeze_step = int(freeze_step)
        self.optimizer = base_optimizer(engine)
        self.frozen: Optional[List[torch.Tensor]] = None
        self.live: List[torch.Tensor] = []
        self.handle = None
        if self.optimizer is not None and hasattr(self.optimizer, "register_step_post_hook"):
            self.handle = self.optimizer.register_step_post_hook(self._after_step)

    @property
    def active(self) -> bool:
        return self.handle is not None

    def _after_step(self, optimizer, args, kwargs) -> None:
        if int(self.engine.global_steps) < self.freeze_step:  # global_steps: steps before this one
            return
        if self.frozen is None:
            self.live = [s["exp_avg_sq"] for s in optimizer.state.values() if "exp_avg_sq" in s]
            if not self.live:  # not an Adam-type optimizer: nothing to freeze
                self.handle.remove()
                self.handle = None
                return
            self.frozen = [v.detach().clone() for v in self.live]
            print_dist(f"DRAGONN: Adam variance frozen from step {int(self.engine.global_steps) + 1} "
                       f"({sum(v.numel() for v in self.live)} elements; 1-bit Adam's remedy for error feedback "
                       f"under Adam)", ranks=[0])
            return
        torch._foreach_copy_(self.live, self.frozen)

    def reset(self) -> None:
        """Take a new snapshot at the next step (after a checkpoint load replaced the optimizer state)."""
        self.frozen, self.live = None, []
