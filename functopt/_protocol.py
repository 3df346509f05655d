"""The protocol's types: [`GradientTransformation`][functopt.GradientTransformation], its two
functions and their trees. The bottom layer: ``functopt._spec`` describes transforms of this
type and ``functopt._base`` (which documents and exports these names) builds its basic
transforms with such descriptions."""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

Params = Any
"""A pytree of tensors (nested dict / list / tuple / NamedTuple; ``None`` leaves allowed)."""
Updates = Any
"""A pytree of tensors shaped like the params (gradients going in, updates coming out)."""
State = Any
"""A transform's state: a NamedTuple (or pytree of NamedTuples) of tensors."""


class TransformInitFn(Protocol):
    """``init(params) -> state``."""

    def __call__(self, params: Params) -> State: ...


class TransformUpdateFn(Protocol):
    """``update(updates, state, params=None, **extra_args) -> (updates, state)``."""

    def __call__(
        self, updates: Updates, state: State, params: Params | None = None, **extra_args: Any
    ) -> tuple[Updates, State]: ...


class GradientTransformation(NamedTuple):
    """A pure gradient transformation: ``init`` and ``update``.

    ``update(updates, state, params=None, **extra_args)`` must not mutate any of its
    inputs, and must ignore extra keyword arguments it does not know (so that one call can
    feed every transform of a chain, each reading what it needs, such as ``value`` or
    ``loss``).

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.scale(-0.1)
        >>> params = {"w": torch.ones(2)}
        >>> state = tx.init(params)
        >>> updates, state = tx.update({"w": torch.tensor([1.0, 2.0])}, state)
        >>> updates["w"]
        tensor([-0.1000, -0.2000])
    """

    init: TransformInitFn
    update: TransformUpdateFn
