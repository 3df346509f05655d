"""functopt: functional, optax-style optimizer transforms for PyTorch."""

from functopt import precision, tree
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
from functopt.transforms import (
    accumulation as _accumulation,
    adding as _adding,
    clipping as _clipping,
    combining as _combining,
    conditionality as _conditionality,
    constrain as _constrain,
    factored as _factored,
    hyperparams as _hyperparams,
    masking as _masking,
    moments as _moments,
    multi_steps as _multi_steps,
    partition as _partition,
    projection as _projection,
    scaling as _scaling,
    sign as _sign,
    trust_ratio as _trust_ratio,
)
from functopt.precision.loss_scale import (
    LossScale,
    LossScaleState,
    dynamic_loss_scale,
    static_loss_scale,
)
from functopt.transforms.accumulation import *  # noqa: F403  (made explicit at integration)
from functopt.transforms.adding import *  # noqa: F403
from functopt.transforms.clipping import *  # noqa: F403
from functopt.transforms.combining import *  # noqa: F403
from functopt.transforms.conditionality import *  # noqa: F403
from functopt.transforms.constrain import *  # noqa: F403
from functopt.transforms.factored import *  # noqa: F403
from functopt.transforms.hyperparams import *  # noqa: F403
from functopt.transforms.masking import *  # noqa: F403
from functopt.transforms.moments import *  # noqa: F403
from functopt.transforms.multi_steps import *  # noqa: F403
from functopt.transforms.partition import *  # noqa: F403
from functopt.transforms.projection import *  # noqa: F403
from functopt.transforms.scaling import *  # noqa: F403
from functopt.transforms.sign import *  # noqa: F403
from functopt.transforms.trust_ratio import *  # noqa: F403

__version__ = "0.1.0"

__all__ = [
    "EmptyState",
    "LossScale",
    "LossScaleState",
    "GradientTransformation",
    "Numeric",
    "Params",
    "ScalarOrSchedule",
    "Schedule",
    "State",
    "TransformInitFn",
    "TransformUpdateFn",
    "Updates",
    "apply_updates",
    "apply_updates_",
    "dynamic_loss_scale",
    "identity",
    "precision",
    "set_to_zero",
    "static_loss_scale",
    "stateless",
    "stateless_with_tree_map",
    "tree",
    "with_extra_args_support",
    *_accumulation.__all__,
    *_adding.__all__,
    *_clipping.__all__,
    *_combining.__all__,
    *_conditionality.__all__,
    *_constrain.__all__,
    *_factored.__all__,
    *_hyperparams.__all__,
    *_masking.__all__,
    *_moments.__all__,
    *_multi_steps.__all__,
    *_partition.__all__,
    *_projection.__all__,
    *_scaling.__all__,
    *_sign.__all__,
    *_trust_ratio.__all__,
]
