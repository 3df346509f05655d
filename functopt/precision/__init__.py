"""Mixed precision: loss scales, gradient statistics, and the exact mixed-precision step.

[`mixed_precision`][functopt.precision.mixed_precision] wraps any gradient transformation
into a complete float16/bfloat16 step that owns a float32 master copy and the write of the
params (see its module for the order of operations and why the write must be its own).
"""

from functopt.precision.loss_scale import (
    LossScale,
    LossScaleState,
    dynamic_loss_scale,
    static_loss_scale,
)
from functopt.precision.master import MasterWeights, float32_master
from functopt.precision.stats import GradStats, grad_stats, unpack_grad_stats
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
    "MasterWeights",
    "MixedPrecisionState",
    "MixedPrecisionTransformation",
    "StepMetrics",
    "dynamic_loss_scale",
    "float32_master",
    "grad_stats",
    "mixed_precision",
    "scale_loss",
    "select_tree",
    "static_loss_scale",
    "unpack_grad_stats",
]
