"""Applying a transform to part of the tree: ``masked``.

The leaves a mask leaves out are handed to the inner transform as ``None``, which every
functopt transform treats as a parameter without gradient: the inner transform keeps no state
for them, and their updates pass through ``masked`` untouched. optax marks such leaves with
an empty ``MaskedNode`` instead; ``None`` keeps the inner state in the params' structure,
which checkpointing and ``functopt.tree`` lookups by path rely on.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

from functopt import _validate
from functopt._base import (
    GradientTransformation,
    Params,
    State,
    Updates,
    with_extra_args_support,
)
from functopt._spec import Select, describe, specified
from functopt.tree import _core

__all__ = [
    "MaskedState",
    "masked",
]

Mask = Any
"""A pytree of bools with the params' structure, or a prefix of it (one bool per subtree)."""


class MaskedState(NamedTuple):
    """State of [`masked`][functopt.masked]."""

    inner_state: State  # the inner transform's state, built on the params with None at
    # every leaf the mask leaves out (so per-leaf fields hold None there)


def _check_mask_leaves(leaves: list[Any], treespec: _core.TreeSpec) -> None:
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, bool):
            where = _core.paths(treespec)[i]
            raise TypeError(
                f"masked: mask leaf {where!r} is {_core._describe(leaf)}; expected True or "
                f"False (a Python bool: the mask decides the structure of the inner state, "
                f"so it cannot be a tensor). Fix: build the mask with Python bools, e.g. "
                f"{{name: p.dim() > 1 for name, p in params.items()}}."
            )


def _broadcast(
    mask_tree: Mask, treespec: _core.TreeSpec, target: Any, target_name: str
) -> list[bool]:
    """One bool per leaf of ``target`` (of structure ``treespec``), from a prefix mask."""
    mask_leaves, mask_spec = _core.flatten(mask_tree)
    _check_mask_leaves(mask_leaves, mask_spec)
    try:
        return _core.broadcast_prefix(mask_tree, target, treespec)
    except ValueError as where:
        raise ValueError(
            f"masked: the mask must have the structure of the {target_name}, or of a prefix "
            f"of it; it differs {where} (expected: the mask's node; got: the "
            f"{target_name}'). Fix: build the mask from the params (for example with a "
            f"function params -> mask), putting one bool where a whole subtree shares it."
        ) from None


def masked(
    inner: GradientTransformation,
    mask: Mask | Callable[[Params], Mask],
    *,
    mask_compatible_extra_args: bool = False,
) -> GradientTransformation:
    r"""Apply ``inner`` to the leaves where ``mask`` is True; pass the others through.

    With $M$ the set of leaves whose mask is True, the result is
    $u_i \leftarrow \text{inner}(u_M)_i$ for $i \in M$ and
    $u_i \leftarrow u_i$ (the same tensor object) otherwise. ``inner`` sees trees with
    the full structure but ``None`` at the leaves outside $M$, in the updates, in the
    params, and when it builds its state, so it keeps no state for them and its reductions
    (a global norm, say) cover $M$ only.

    ``mask`` may be a prefix of the params' structure (``True`` for a whole subtree, or a
    single ``True`` for everything), or a function that returns such a tree. The function
    is called on the params in ``init``, and in ``update`` on the params when they are
    passed, else on the updates (optax always calls it on the updates; params never hold
    ``None`` for a parameter without gradient, so a mask function such as
    ``lambda p: {k: v.dim() > 1 for k, v in p.items()}`` works on them unchanged).

    Args:
        inner: the transform to apply to the masked leaves.
        mask: a pytree of bools (the params' structure or a prefix of it), or
            ``params -> such a pytree``.
        mask_compatible_extra_args: also mask the extra keyword arguments of ``update``
            whose structure is the updates' (per-leaf side inputs).

    Returns:
        A [`GradientTransformation`][functopt.GradientTransformation] with [`MaskedState`][functopt.MaskedState].

    Examples:
        >>> import torch, functopt
        >>> params = {"w": torch.ones(2, 2), "b": torch.ones(2)}
        >>> tx = functopt.masked(functopt.scale(-1.0), lambda p: {k: v.dim() > 1 for k, v in p.items()})
        >>> state = tx.init(params)
        >>> updates, state = tx.update({"w": torch.ones(2, 2), "b": torch.ones(2)}, state, params)
        >>> updates["w"][0], updates["b"]
        (tensor([-1., -1.]), tensor([1., 1.]))
    """
    _validate.check_flags("masked", mask_compatible_extra_args=mask_compatible_extra_args)
    if not isinstance(inner, GradientTransformation):
        raise TypeError(
            f"masked: inner must be a functopt.GradientTransformation, got "
            f"{type(inner).__name__}. Fix: pass a transform, e.g. masked(add_decayed_weights(1e-4), "
            f"mask)."
        )
    inner = with_extra_args_support(inner)
    mask_is_fn = callable(mask)
    if not mask_is_fn:
        _check_mask_leaves(*_core.flatten(mask))
    # A fixed mask broadcasts the same way for every step; cache it per treespec.
    cache: dict[_core.TreeSpec, list[bool]] = {}

    def mask_for(source: Any, treespec: _core.TreeSpec, target: Any, name: str) -> list[bool]:
        if mask_is_fn:
            return _broadcast(mask(source), treespec, target, name)
        if treespec not in cache:
            cache[treespec] = _broadcast(mask, treespec, target, name)
        return cache[treespec]

    def init_fn(params: Params) -> MaskedState:
        leaves, treespec = _core.flatten(params)
        keep = mask_for(params, treespec, params, "params")
        inner_params = _core.unflatten(
            treespec, [p if m else None for p, m in zip(leaves, keep, strict=True)]
        )
        return MaskedState(inner_state=inner.init(inner_params))

    def update_fn(
        updates: Updates, state: MaskedState, params: Params | None = None, **extra_args: Any
    ) -> tuple[Updates, MaskedState]:
        if not isinstance(state, MaskedState):
            raise TypeError(
                f"masked: state must be the MaskedState returned by this transform's init or "
                f"update, got {type(state).__name__}."
            )
        leaves, treespec = _core.flatten(updates)
        _core.check_tensors(leaves, treespec, name="updates")
        keep = mask_for(updates if params is None else params, treespec, updates, "updates")

        def hide(values: list[Any]) -> Any:
            return _core.unflatten(
                treespec, [v if m else None for v, m in zip(values, keep, strict=True)]
            )

        inner_params = None
        if params is not None:
            inner_params = hide(
                _core.flatten_like(treespec, params, name="params", reference="updates")
            )
        if mask_compatible_extra_args:
            extra_args = {
                k: hide(treespec.flatten_up_to(v)) if _core.structure(v) == treespec else v
                for k, v in extra_args.items()
            }
        inner_updates, inner_state = inner.update(
            hide(leaves), state.inner_state, inner_params, **extra_args
        )
        new_leaves = _core.flatten_like(
            treespec, inner_updates, name="the inner transform's updates", reference="updates"
        )
        out = [n if m else u for n, u, m in zip(new_leaves, leaves, keep, strict=True)]
        return _core.unflatten(treespec, out), MaskedState(inner_state=inner_state)

    def select(params: Params, treespec: _core.TreeSpec, leaves: list[Any],
               ) -> dict[Hashable, list[int]]:
        keep = mask_for(params, treespec, params, "params")
        return {True: [i for i, m in enumerate(keep) if m]}

    return specified(GradientTransformation(init_fn, update_fn), Select(
        {True: describe(inner)}, select, lambda state, key: state.inner_state, "masked"))
