"""A param group's first transform state, made from the group's own hyperparameters.

``inject_hyperparams`` builds its ``init`` from the values the transform was built with.
Most transforms read their hyperparameters at every update only, but some read one when
their state is created: Rprop's initial step size is the learning rate, Adagrad's
accumulator starts at ``initial_accumulator_value``. torch.optim creates each param's state
from its group's values, so a group that sets its own must start from them too.
"""

from __future__ import annotations

from typing import Any

import torch

from functopt._base import GradientTransformation, State
from functopt._spec import Injected, describe
from functopt.transforms.hyperparams import InjectHyperparamsState

__all__: list[str] = []


def differs(built: dict[str, torch.Tensor], group: dict[str, Any]) -> bool:
    """Whether a group's hyperparameters (0-d tensors) are not the ones ``init`` uses."""
    for name, value in group.items():
        held = built.get(name)
        if held is None or value is held:
            continue
        if value.requires_grad or value.is_meta or held.is_meta:
            return True  # (meta params: no values to compare, the group's make the state)
        if not torch.equal(value.detach(), held):
            return True
    return False


def init_from_group(transform: GradientTransformation, ptree: Any,
                    hyper: dict[str, torch.Tensor]) -> State:
    """``transform.init(ptree)`` with the inner transform built from ``hyper`` (the group's
    injected values, 0-d tensors), as an update builds it; a transform that injects nothing
    is initialised as it is."""
    state = transform.init(ptree)
    spec = describe(transform)
    if not isinstance(state, InjectHyperparamsState) or not isinstance(spec, Injected):
        return state
    values = {**state.hyperparams, **hyper}
    return state._replace(hyperparams=values, inner_state=spec.build(values).init(ptree))
