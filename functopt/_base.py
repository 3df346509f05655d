"""The transform protocol: the one abstraction everything else in functopt is built from.

A [`GradientTransformation`][functopt.GradientTransformation] is a pair of pure functions. ``init(params)`` builds the
state; ``update(updates, state, params=None, **extra_args)`` returns new updates and a new
state, without touching its inputs. Optimizers are chains of such transforms; the caller
holds the state and passes it back on the next step.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from functopt import _validate
from functopt._protocol import (
    GradientTransformation,
    Params,
    State,
    TransformInitFn,
    TransformUpdateFn,
    Updates,
)
from functopt._spec import Leafwise, describe, specified
from functopt.tree import _core

__all__ = ["EmptyState", "GradientTransformation", "Numeric", "Params", "ScalarOrSchedule",
           "Schedule", "State", "TransformInitFn", "TransformUpdateFn", "Updates",
           "accepts_extra_args", "identity", "set_to_zero", "stateless", "stateless_with_tree_map",
           "with_extra_args_support"]

Numeric = float | int | torch.Tensor
"""A hyperparameter: a Python number, or a 0-d tensor (as ``inject_hyperparams`` passes)."""
Schedule = Callable[[Any], Any]
"""``step -> value``: a function of the step count (an int or a 0-d integer tensor)."""
ScalarOrSchedule = float | int | torch.Tensor | Schedule
"""A hyperparameter that may also be a schedule."""


class EmptyState(NamedTuple):
    """The state of a stateless transform."""


def identity() -> GradientTransformation:
    """The transform that returns its updates unchanged (the neutral element of ``chain``).

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.identity()
        >>> tx.update({"w": torch.ones(1)}, tx.init({"w": torch.zeros(1)}))[0]
        {'w': tensor([1.])}
    """

    def init_fn(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update_fn(
        updates: Updates, state: State, params: Params | None = None, **extra_args: Any
    ) -> tuple[Updates, State]:
        del params, extra_args
        _validate.check_state("identity", state, EmptyState)
        return updates, state

    return specified(GradientTransformation(init_fn, update_fn), Leafwise(
        "identity", slots=(), kernel="identity"))


def set_to_zero() -> GradientTransformation:
    """Replace every update by zeros (frozen parameters: use it inside ``partition``).

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.set_to_zero()
        >>> tx.update({"w": torch.ones(2)}, tx.init(None))[0]
        {'w': tensor([0., 0.])}
    """

    def update_fn(
        updates: Updates, state: State, params: Params | None = None, **extra_args: Any
    ) -> tuple[Updates, State]:
        del params, extra_args
        _validate.check_state("set_to_zero", state, EmptyState)
        leaves, treespec = _core.flatten(updates)
        _core.check_tensors(leaves, treespec, name="updates")
        return _core.unflatten(treespec, _core.map_leaves(torch.zeros_like, leaves)), state

    return specified(GradientTransformation(identity().init, update_fn),
                     Leafwise("set_to_zero", slots=(), kernel="zero"))


def stateless(
    f: Callable[[Updates, Params | None], Updates],
) -> GradientTransformation:
    """Make a stateless transform from ``f(updates, params) -> updates`` over whole trees.

    Examples:
        >>> import torch, functopt
        >>> halve = functopt.stateless(lambda u, p: {k: v / 2 for k, v in u.items()})
        >>> halve.update({"w": torch.ones(1)}, halve.init(None))[0]
        {'w': tensor([0.5000])}
    """

    def update_fn(
        updates: Updates, state: State, params: Params | None = None, **extra_args: Any
    ) -> tuple[Updates, State]:
        del extra_args
        return f(updates, params), state

    return GradientTransformation(identity().init, update_fn)


def stateless_with_tree_map(
    f: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
) -> GradientTransformation:
    """Make a stateless transform from a per-leaf ``f(update, param) -> update``.

    ``f`` is not called where the update is ``None`` (a parameter without gradient); the
    param passed is ``None`` when ``update`` is called without params.

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.stateless_with_tree_map(lambda g, p: g.clamp(-1, 1))
        >>> tx.update([torch.tensor([3.0, -0.5])], tx.init(None))[0]
        [tensor([ 1.0000, -0.5000])]
    """

    def update_fn(
        updates: Updates, state: State, params: Params | None = None, **extra_args: Any
    ) -> tuple[Updates, State]:
        del extra_args
        leaves, treespec = _core.flatten(updates)
        _core.check_tensors(leaves, treespec, name="updates")
        if params is None:
            param_leaves: list[Any] = [None] * len(leaves)
        else:
            param_leaves = _core.flatten_like(treespec, params, name="params", reference="updates")
        return _core.unflatten(treespec, _core.map_leaves(f, leaves, param_leaves)), state

    return GradientTransformation(identity().init, update_fn)


def accepts_extra_args(update: Callable[..., Any]) -> bool:
    """Whether ``update`` takes ``**kwargs`` (so extra args can be passed to it as they are)."""
    try:
        parameters = inspect.signature(update).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def with_extra_args_support(tx: GradientTransformation) -> GradientTransformation:
    """Wrap a transform whose ``update`` lacks ``**extra_args`` so that it ignores them.

    Combinators apply this to their children, so user transforms written as
    ``update(updates, state, params=None)`` compose with everything else.

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.GradientTransformation(
        ...     lambda params: (), lambda updates, state, params=None: (updates, state))
        >>> wrapped = functopt.with_extra_args_support(tx)
        >>> wrapped.update({"w": torch.ones(1)}, (), loss=torch.tensor(0.5))[0]
        {'w': tensor([1.])}
    """
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise TypeError(
            f"with_extra_args_support: expected a GradientTransformation (init and update), "
            f"got {type(tx).__name__}. Fix: pass a transform such as functopt.sgd(0.1)."
        )
    if accepts_extra_args(tx.update):
        return tx
    inner_update = tx.update

    @functools.wraps(inner_update)
    def update_fn(
        updates: Updates, state: State, params: Params | None = None, **extra_args: Any
    ) -> tuple[Updates, State]:
        del extra_args
        return inner_update(updates, state, params)

    spec = describe(tx)  # a rule keeps its description (the fast tiers read it)
    wrapped = GradientTransformation(tx.init, update_fn)
    return wrapped if spec is None else specified(wrapped, spec)
