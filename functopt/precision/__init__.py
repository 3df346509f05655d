"""Mixed precision: loss scales, gradient statistics, and the exact mixed-precision step.

[`mixed_precision`][functopt.precision.mixed_precision] wraps any gradient transformation
into a complete float16/bfloat16 step that owns a float32 master copy and the write of the
params (see its module for the order of operations and why the write must be its own).
The master-weight strategies trade memory for precision:
[`float32_master`][functopt.precision.float32_master] (exact),
[`kahan_summation`][functopt.precision.kahan_summation] (a compensation word) and
[`stochastic_rounding`][functopt.precision.stochastic_rounding] (no store, unbiased).
[`Policy`][functopt.precision.Policy] and [`get_policy`][functopt.precision.get_policy]
are jmp's dtype policies: which dtype params are kept in, computed in, and returned in.
ZeRO-1, the same step for replicated (DDP) params with the state and master sharded over
the data-parallel ranks, is a sharding strategy and lives one layer up, in
[`functopt.distributed.zero1`][functopt.distributed.zero1].
"""

from functopt.precision.loss_scale import (
    LossScale,
    LossScaleState,
    LossScaleWarning,
    dynamic_loss_scale,
    loss_scale_collapsed,
    static_loss_scale,
)
from functopt.precision.master import (
    MasterWeights,
    float32_master,
    kahan_summation,
    stochastic_rounding,
)
from functopt.precision.policy import Policy, get_policy
from functopt.precision.stats import GradStats, NormClip, grad_stats, unpack_grad_stats
from functopt.precision.step import (
    MixedPrecisionState,
    MixedPrecisionTransformation,
    StepMetrics,
    mixed_precision,
    scale_loss,
    select_tree,
)

__all__ = [
    "GradStats",
    "LossScale",
    "LossScaleState",
    "LossScaleWarning",
    "MasterWeights",
    "MixedPrecisionState",
    "MixedPrecisionTransformation",
    "NormClip",
    "Policy",
    "StepMetrics",
    "dynamic_loss_scale",
    "float32_master",
    "get_policy",
    "grad_stats",
    "kahan_summation",
    "loss_scale_collapsed",
    "mixed_precision",
    "scale_loss",
    "select_tree",
    "static_loss_scale",
    "stochastic_rounding",
    "unpack_grad_stats",
]
