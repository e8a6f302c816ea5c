"""The DeepSpeed hooks: DeepSpeed's flattened gradient buckets in, averaged gradients out.

One module per hook point, sharing the pipeline, the residual store and the step transaction
(``base.py``):

* ``stage0.py``: ZeRO stage 0, ``DeepSpeedEngine.allreduce_bucket`` / ``allreduce_and_copy``;
* ``stage_1_and_2.py``: ZeRO stage 1/2, ``DeepSpeedZeroOptimizer.average_tensor`` (sparse reduce-scatter).

Beside them: ``bucket.py`` (the bucket key and seeds), ``decision.py`` (dense or compressed, density,
segments), ``reporting.py`` (logs, monitor events, telemetry), ``state.py`` (what a rank's state holds and
how it loads), ``checkpoint.py`` (that state in DeepSpeed's checkpoints, collective save/load),
``steps.py`` (the step transaction of engines that may skip steps), ``adam.py`` (the opt-in frozen Adam
variance) and ``teardown.py`` (the orderly exit ``ds_dragonn.initialize`` registers).
"""
from .base import HookBase
from .bucket import BucketKey, bucket_seed
from .stage0 import Scales, Stage0Hook, check_hook_point, reduction_scales
from .stage_1_and_2 import Stage12Hook, check_zero_hook_point

__all__ = ["BucketKey", "HookBase", "Scales", "Stage0Hook", "Stage12Hook", "bucket_seed", "check_hook_point",
           "check_zero_hook_point", "reduction_scales"]
