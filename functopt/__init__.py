"""functopt: functional, optax-style optimizer transforms for PyTorch.

The public surface is this module's ``__all__`` and the documented subpackages
``functopt.schedules``, ``functopt.tree``, ``functopt.precision``, ``functopt.distributed``,
``functopt.fast``, ``functopt.contrib``, ``functopt.optim``, ``functopt.lightrft``
(LightRFT's optimizer names) and ``functopt.testing`` (which imports hypothesis, so it
is not imported here).
"""

from functopt import (
    _serialization,
    contrib,
    distributed,
    fast,
    lightrft,
    optim,
    precision,
    schedules,
    tree,
)
from functopt._apply import apply_updates, apply_updates_
from functopt._base import (
    EmptyState,
    GradientTransformation,
    Numeric,
    Params,
    ScalarOrSchedule,
    Schedule,
    State,
    TransformInitFn,
    TransformUpdateFn,
    Updates,
    identity,
    set_to_zero,
    stateless,
    stateless_with_tree_map,
    with_extra_args_support,
)
from functopt._rank_checkpoint import load_rank_checkpoint, save_rank_checkpoint
from functopt._rules import elementwise_rule, per_leaf_rule, state_slots
from functopt._serialization import (
    load_checkpoint,
    safe_globals,
    save_checkpoint,
    state_classes,
)
from functopt.adapters import ChainedOptimizer, MixedPrecisionOptimizer, Optimizer, ProxyDict
from functopt.optimizers import (
    adadelta,
    adafactor,
    adagrad,
    adam,
    adamax,
    adamw,
    amsgrad,
    lamb,
    lars,
    lion,
    nadam,
    nadamw,
    radam,
    rmsprop,
    rprop,
    sgd,
    sign_sgd,
)
from functopt.precision.loss_scale import (
    LossScale,
    LossScaleState,
    dynamic_loss_scale,
    static_loss_scale,
)
from functopt.transforms.accumulation import (
    DampenedTraceState,
    EmaState,
    TraceState,
    dampened_trace,
    ema,
    trace,
)
from functopt.transforms.adding import (
    AddDecayedWeightsState,
    add_decayed_weights,
)
from functopt.transforms.clipping import (
    adaptive_grad_clip,
    clip,
    clip_by_block_rms,
    clip_by_global_norm,
)
from functopt.transforms.combining import (
    chain,
    named_chain,
)
from functopt.transforms.conditionality import (
    ApplyIfFiniteState,
    apply_if_finite,
)
from functopt.transforms.constrain import (
    ZeroNansState,
    keep_params_nonnegative,
    zero_nans,
)
from functopt.transforms.factored import (
    FactoredState,
    scale_by_factored_rms,
)
from functopt.transforms.hyperparams import (
    InjectHyperparamsState,
    inject_hyperparams,
)
from functopt.transforms.masking import (
    MaskedState,
    masked,
)
from functopt.transforms.moments import (
    ScaleByAdamState,
    ScaleByAmsgradState,
    ScaleByLionState,
    ScaleByNadamState,
    scale_by_adam,
    scale_by_adamax,
    scale_by_amsgrad,
    scale_by_lion,
    scale_by_nadam,
    scale_by_radam,
)
from functopt.transforms.multi_steps import (
    MultiSteps,
    MultiStepsState,
    ShouldSkipUpdateFunction,
    skip_large_updates,
    skip_not_finite,
)
from functopt.transforms.partition import (
    PartitionState,
    partition,
)
from functopt.transforms.projection import (
    centralize,
)
from functopt.transforms.rms import (
    ScaleByAdaDeltaState,
    ScaleByRmsState,
    ScaleByRssState,
    ScaleByRStdDevState,
    scale_by_adadelta,
    scale_by_rms,
    scale_by_rss,
    scale_by_stddev,
)
from functopt.transforms.scaling import (
    ScaleByScheduleState,
    scale,
    scale_by_learning_rate,
    scale_by_param_block_norm,
    scale_by_param_block_rms,
    scale_by_schedule,
)
from functopt.transforms.sign import (
    ScaleByRpropState,
    scale_by_rprop,
    scale_by_sign,
)
from functopt.transforms.trust_ratio import (
    scale_by_trust_ratio,
)

__version__ = "0.1.0"

__all__ = [
    "AddDecayedWeightsState",
    "ApplyIfFiniteState",
    "ChainedOptimizer",
    "DampenedTraceState",
    "EmaState",
    "EmptyState",
    "FactoredState",
    "GradientTransformation",
    "InjectHyperparamsState",
    "LossScale",
    "LossScaleState",
    "MaskedState",
    "MixedPrecisionOptimizer",
    "MultiSteps",
    "MultiStepsState",
    "Numeric",
    "Optimizer",
    "Params",
    "PartitionState",
    "ProxyDict",
    "ScalarOrSchedule",
    "ScaleByAdaDeltaState",
    "ScaleByAdamState",
    "ScaleByAmsgradState",
    "ScaleByLionState",
    "ScaleByNadamState",
    "ScaleByRStdDevState",
    "ScaleByRmsState",
    "ScaleByRpropState",
    "ScaleByRssState",
    "ScaleByScheduleState",
    "Schedule",
    "ShouldSkipUpdateFunction",
    "State",
    "TraceState",
    "TransformInitFn",
    "TransformUpdateFn",
    "Updates",
    "ZeroNansState",
    "adadelta",
    "adafactor",
    "adagrad",
    "adam",
    "adamax",
    "adamw",
    "adaptive_grad_clip",
    "add_decayed_weights",
    "amsgrad",
    "apply_if_finite",
    "apply_updates",
    "apply_updates_",
    "centralize",
    "chain",
    "clip",
    "clip_by_block_rms",
    "clip_by_global_norm",
    "contrib",
    "dampened_trace",
    "distributed",
    "dynamic_loss_scale",
    "elementwise_rule",
    "ema",
    "fast",
    "identity",
    "inject_hyperparams",
    "keep_params_nonnegative",
    "lamb",
    "lars",
    "lightrft",
    "lion",
    "load_checkpoint",
    "load_rank_checkpoint",
    "masked",
    "nadam",
    "nadamw",
    "named_chain",
    "optim",
    "partition",
    "per_leaf_rule",
    "precision",
    "radam",
    "rmsprop",
    "rprop",
    "safe_globals",
    "save_checkpoint",
    "save_rank_checkpoint",
    "scale",
    "scale_by_adadelta",
    "scale_by_adam",
    "scale_by_adamax",
    "scale_by_amsgrad",
    "scale_by_factored_rms",
    "scale_by_learning_rate",
    "scale_by_lion",
    "scale_by_nadam",
    "scale_by_param_block_norm",
    "scale_by_param_block_rms",
    "scale_by_radam",
    "scale_by_rms",
    "scale_by_rprop",
    "scale_by_rss",
    "scale_by_schedule",
    "scale_by_sign",
    "scale_by_stddev",
    "scale_by_trust_ratio",
    "schedules",
    "set_to_zero",
    "sgd",
    "sign_sgd",
    "skip_large_updates",
    "skip_not_finite",
    "state_classes",
    "state_slots",
    "stateless",
    "stateless_with_tree_map",
    "static_loss_scale",
    "trace",
    "tree",
    "with_extra_args_support",
    "zero_nans",
]

# The one global side effect of the import, on purpose: PyTorch's default torch.load
# (weights_only=True) accepts functopt's state classes (plain data) from here on.
_serialization.allow_state_classes()
