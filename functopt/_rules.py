r"""Rule metadata: how a transform says what its fast tiers need to know.

A [`GradientTransformation`][functopt.GradientTransformation] is two closures that
nothing can look inside, so on its own a transform runs on the pure path only. A *rule*
also states the facts the fast tiers of [`functopt.fast`][functopt.fast] lower it by:

- its name, which [`explain`][functopt.fast.explain] and the fast paths' messages use;
- which fields of its ``<Name>State`` hold one tensor per leaf (its *slots*), derived
  from the NamedTuple's annotations by [`state_slots`][functopt._rules.state_slots];
- whether it is *elementwise* (each element of its update comes from the same element of
  the gradient, state and param: [`elementwise_rule`][functopt._rules.elementwise_rule])
  or works on each leaf whole (a norm of the leaf, a matrix function:
  [`per_leaf_rule`][functopt._rules.per_leaf_rule]);
- for an elementwise rule whose update also sums over all its leaves, that update as two
  halves (``sums`` and ``finish``), so that the sums can be taken over every group of
  leaves and every rank before the second half runs.

The rule's own ``update`` stays the reference: the compiled tier runs it on a group's
leaves laid end to end, the per-leaf tier on a group's leaves, and both are held equal to
the pure path. Every transform of functopt states its facts the same way.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Mapping
from typing import Any

import torch

from functopt._base import GradientTransformation
from functopt._spec import Leafwise, PerLeaf, specified

__all__ = ["elementwise_rule", "per_leaf_rule", "state_slots"]


# The annotations' text where their names do not resolve (a class made by exec, say).
_PER_LEAF = ("Updates", "Params", "Any", "functopt.Updates", "functopt.Params", "typing.Any")
_SHARED = ("torch.Tensor", "Tensor")


def state_slots(state: type) -> tuple[str, ...]:
    """The fields of a ``<Name>State`` NamedTuple that hold one tensor per leaf.

    The annotations say it: a field annotated [`Updates`][functopt.Updates] or
    [`Params`][functopt.Params] (a tree like the params) holds a tensor per leaf; a field
    annotated ``torch.Tensor`` (a count, a 0-d constant) is shared by the leaves.

    Args:
        state: the NamedTuple class the rule's ``init`` returns.

    Returns:
        The per-leaf fields, in the NamedTuple's order.

    Raises:
        TypeError: ``state`` is not a NamedTuple class, or a field has another annotation.

    Examples:
        >>> import functopt
        >>> functopt.state_slots(functopt.ScaleByAdamState)
        ('mu', 'nu')
        >>> functopt.state_slots(functopt.ScaleByNadamState)  # mu_product is shared
        ('mu', 'nu')
    """
    fields = getattr(state, "_fields", None)
    if not (isinstance(state, type) and issubclass(state, tuple) and isinstance(fields, tuple)):
        raise TypeError(f"state_slots: expected a NamedTuple class (a rule's <Name>State), got "
                        f"{state!r}. Fix: pass the class its init returns.")
    try:
        hints = typing.get_type_hints(state)
    except NameError:  # (a class whose module's names are out of reach: read their text)
        hints = {}
    raw = getattr(state, "__annotations__", {})
    slots = []
    for name in fields:
        hint = hints.get(name, raw.get(name))
        text = hint.__forward_arg__ if isinstance(hint, typing.ForwardRef) else hint
        if hint is Any or text in _PER_LEAF:  # Updates and Params are Any
            slots.append(name)
        elif hint is not torch.Tensor and text not in _SHARED:
            raise TypeError(
                f"state_slots: {state.__name__}.{name} is annotated {text!r}; expected "
                f"functopt.Updates or functopt.Params (one tensor per leaf) or torch.Tensor "
                f"(one value shared by the leaves). Fix: annotate it as one of those.")
    return tuple(slots)


# The names the fast paths give their own steps: a rule of that name would be taken for one.
_RESERVED = ("identity", "set_to_zero", "apply_if_finite", "clip_by_global_norm")


def _checked(owner: str, tx: Any, name: Any, hyperparams: Any,
             functions: Mapping[str, Any]) -> None:
    if hyperparams is not None and not isinstance(hyperparams, Mapping):
        raise TypeError(f"{owner}: expected hyperparams as a dict of the rule's arguments "
                        f"(or None), got {type(hyperparams).__name__}. Fix: pass "
                        f"hyperparams={{'decay': decay}}.")
    for key, fn in functions.items():
        if fn is not None and not callable(fn):
            raise TypeError(f"{owner}: expected {key} as a function (or None), got "
                            f"{type(fn).__name__}.")
    if not isinstance(tx, GradientTransformation):
        raise TypeError(f"{owner}: expected a GradientTransformation, got {type(tx).__name__}. "
                        f"Fix: pass GradientTransformation(init_fn, update_fn).")
    if not (isinstance(name, str) and name.isidentifier()):
        raise ValueError(f"{owner}: expected the rule's name as an identifier "
                         f"(\"scale_by_adan\"), got {name!r}.")
    if name in _RESERVED:
        raise ValueError(f"{owner}: the name {name!r} is functopt's own "
                         f"functopt.{name}; the fast paths would take the rule for it. Fix: "
                         f"give the rule a name of its own.")


def elementwise_rule(tx: GradientTransformation, name: str, *, state: type,
                     hyperparams: Mapping[str, Any] | None = None,
                     sums: Callable[..., Any] | None = None,
                     finish: Callable[..., Any] | None = None) -> GradientTransformation:
    """``tx``, an elementwise rule, with the facts that let the fast tiers lower it.

    Elementwise: every element of ``tx.update``'s output and new per-leaf state comes from
    the same element of its updates, per-leaf state and params (and from the shared state
    fields), with no reduction within a leaf and no use of a leaf's shape. Then its update
    over a group's leaves laid end to end in one flat tensor equals its update leaf by
    leaf, and ``make_step(tx, compile=True)`` runs it as one compiled call per group.

    Args:
        tx: the rule's transform; its ``init`` returns a ``state`` and its ``update`` may be
            called on flat tensors, one per per-leaf field.
        name: its name in [`explain`][functopt.fast.explain] and the fast paths' messages.
        state: its ``<Name>State`` NamedTuple class (see
            [`state_slots`][functopt._rules.state_slots]).
        hyperparams: its arguments, shown by ``repr(tx)``.
        sums: for a rule whose update also sums over all its leaves: ``sums(updates, state,
            params)``, this process's sums over the leaves given (a tuple of 0-d tensors).
        finish: with ``sums``: ``finish(updates, state, params, totals)``, the update given
            those sums over every leaf and rank; ``tx.update`` must equal
            ``finish(u, s, p, sums(u, s, p))``.

    Returns:
        The same transform, carrying its description.

    Raises:
        TypeError: ``tx`` is not a transform, ``state`` not a NamedTuple class,
            ``hyperparams`` not a dict, or ``sums`` / ``finish`` not functions.
        ValueError: ``name`` is not an identifier, or only one of ``sums`` and ``finish``
            is given.

    Examples:
        >>> import torch, functopt
        >>> def scale_by_sign_of_momentum(decay=0.9):
        ...     def init_fn(params):
        ...         return functopt.TraceState(
        ...             trace=functopt.tree.map(torch.zeros_like, params))
        ...     def update_fn(updates, state, params=None):
        ...         trace = functopt.tree.map(lambda g, t: decay * t + g, updates, state.trace)
        ...         return functopt.tree.map(torch.sign, trace), functopt.TraceState(trace)
        ...     tx = functopt.GradientTransformation(init_fn, update_fn)
        ...     return functopt.elementwise_rule(tx, "scale_by_sign_of_momentum",
        ...                                      state=functopt.TraceState,
        ...                                      hyperparams={"decay": decay})
        >>> tx = functopt.chain(scale_by_sign_of_momentum(), functopt.scale(-0.1))
        >>> plan = functopt.fast.explain(tx, {"w": torch.ones(3)}, compile=True)
        >>> plan.fast, plan.groups[0].rules
        (True, ('scale_by_sign_of_momentum', 'scale'))
    """
    _checked("elementwise_rule", tx, name, hyperparams, {"sums": sums, "finish": finish})
    if (sums is None) != (finish is None):
        raise ValueError(f"elementwise_rule({name!r}): got only one of sums and finish; a rule "
                         f"with reductions gives its update as both halves.")
    return specified(tx, Leafwise(name, dict(hyperparams or {}), sums=sums, finish=finish,
                                  slots=state_slots(state)))


def per_leaf_rule(tx: GradientTransformation, name: str, *, state: type,
                  hyperparams: Mapping[str, Any] | None = None,
                  grouped: Callable[..., Any] | None = None) -> GradientTransformation:
    """``tx``, a rule that works on each leaf whole, with the facts that let the per-leaf
    tier run it.

    Per leaf: each leaf's update may depend on the whole leaf (its norm, its shape, a
    matrix function of it) but never on another leaf's values; the shared state fields
    (those [`state_slots`][functopt._rules.state_slots] does not name) change, besides a
    ``count``, only on a step where some leaf has a gradient. ``make_step(tx)`` then runs
    ``tx.update`` (or ``grouped``) on one group of leaves at a time, with the chain's other
    rules in the same pass.

    Args:
        tx: the rule's transform.
        name: its name in [`explain`][functopt.fast.explain] and the fast paths' messages.
        state: its ``<Name>State`` NamedTuple class.
        hyperparams: its arguments, shown by ``repr(tx)``.
        grouped: an update with ``tx.update``'s contract (the same trees, the same results
            up to rounding) that may process the leaves with a gradient together (a batch
            of same-shape matrices, say); the per-leaf tier calls it on one group's leaves,
            ``None`` at the others.

    Returns:
        The same transform, carrying its description.

    Raises:
        TypeError: ``tx`` is not a transform, ``state`` not a NamedTuple class,
            ``hyperparams`` not a dict or ``grouped`` not a function.
        ValueError: ``name`` is not an identifier.

    Examples:
        >>> import torch, functopt
        >>> def normalize():  # each leaf's update scaled to unit norm
        ...     def init_fn(params):
        ...         return functopt.EmptyState()
        ...     def update_fn(updates, state, params=None):
        ...         return functopt.tree.map(lambda g: g / g.norm().clamp_min(1e-12),
        ...                                  updates), state
        ...     tx = functopt.GradientTransformation(init_fn, update_fn)
        ...     return functopt.per_leaf_rule(tx, "normalize", state=functopt.EmptyState)
        >>> tx = functopt.chain(normalize(), functopt.scale(-0.1))
        >>> plan = functopt.fast.explain(tx, {"w": torch.ones(3)})
        >>> plan.fast, plan.groups[0].kernel, plan.groups[0].rules
        (True, 'per-leaf', ('normalize', 'scale'))
    """
    _checked("per_leaf_rule", tx, name, hyperparams, {"grouped": grouped})
    return specified(tx, PerLeaf(name, dict(hyperparams or {}), slots=state_slots(state),
                                 grouped=grouped))
