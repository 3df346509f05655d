"""Mixed precision as transforms: loss scales (more stages are being built: unscale,
overflow detection and skip, exact float32 master weights)."""

from functopt.precision.loss_scale import (
    LossScale,
    LossScaleState,
    dynamic_loss_scale,
    static_loss_scale,
)

__all__ = [
    "LossScale",
    "LossScaleState",
    "dynamic_loss_scale",
    "static_loss_scale",
]
