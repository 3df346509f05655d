"""Adapters: stateful, object-style front ends over functopt's functional steps.

[`MixedPrecisionOptimizer`][functopt.MixedPrecisionOptimizer] has the interface of the
training stacks' mixed-precision optimizers (LightRFT's ``FSDPadaptOptimizer``, Megatron-LM's
``MixedPrecisionOptimizer``) and runs [`mixed_precision`][functopt.precision.mixed_precision]
underneath. [`Optimizer`][functopt.Optimizer] is a ``torch.optim.Optimizer`` that drives
a functopt transform, so LR schedulers, closures, hooks and ``GradScaler`` work with it.
"""

from functopt.adapters._chained import ChainedOptimizer, ProxyDict
from functopt.adapters.mixed_precision_optimizer import MixedPrecisionOptimizer
from functopt.adapters.optimizer import Optimizer

__all__ = ["ChainedOptimizer", "MixedPrecisionOptimizer", "Optimizer", "ProxyDict"]
