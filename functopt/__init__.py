"""functopt: functional, optax-style optimizer transforms for PyTorch."""

from functopt import tree
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
    accumulation,
    adding,
    clipping,
    combining,
    conditionality,
    constrain,
    factored,
    hyperparams,
    masking,
    moments,
    multi_steps,
    partition,
    projection,
    scaling,
    sign,
    trust_ratio,
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
    "identity",
    "set_to_zero",
    "stateless",
    "stateless_with_tree_map",
    "tree",
    "with_extra_args_support",
    *accumulation.__all__,
    *adding.__all__,
    *clipping.__all__,
    *combining.__all__,
    *conditionality.__all__,
    *constrain.__all__,
    *factored.__all__,
    *hyperparams.__all__,
    *masking.__all__,
    *moments.__all__,
    *multi_steps.__all__,
    *partition.__all__,
    *projection.__all__,
    *scaling.__all__,
    *sign.__all__,
    *trust_ratio.__all__,
]
