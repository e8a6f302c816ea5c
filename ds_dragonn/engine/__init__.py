"""The DeepSpeed hooks: DeepSpeed's flattened gradient buckets in, averaged gradients out.

One module per hook point, sharing the pipeline, the residual store, the policy and the telemetry
(``base.py``):

* ``stage0.py``: ZeRO stage 0, ``DeepSpeedEngine.allreduce_bucket`` / ``allreduce_and_copy``;
* ``zero.py``: ZeRO stage 1/2, ``DeepSpeedZeroOptimizer.average_tensor`` (sparse reduce-scatter).

Beside them: ``checkpoint.py`` (each rank's state in DeepSpeed's checkpoints, collective save/load),
``steps.py`` (the step transaction of engines that may skip steps), ``adam.py`` (the opt-in frozen Adam
variance) and ``teardown.py`` (the orderly exit ``ds_dragonn.initialize`` registers).
"""
from .base import HookBase, bucket_seed
from .stage0 import DragonnHook, Scales, check_hook_point, reduction_scales
from .zero import ZeroHook, check_zero_hook_point

__all__ = ["DragonnHook", "HookBase", "Scales", "ZeroHook", "bucket_seed", "check_hook_point",
           "check_zero_hook_point", "reduction_scales"]
