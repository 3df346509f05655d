"""Composing transforms: ``chain`` and ``named_chain``."""

from __future__ import annotations

from typing import Any

from functopt._base import (
    GradientTransformation,
    Params,
    State,
    Updates,
    with_extra_args_support,
)
from functopt._spec import Sequence, describe, specified

__all__ = [
    "chain",
    "named_chain",
]


def _check_transform(owner: str, where: str, tx: Any) -> GradientTransformation:
    """Check that ``tx`` is a transform (with a hint for the usual mistakes); wrap it so that
    it ignores extra args it does not take."""
    if not isinstance(tx, GradientTransformation):
        if hasattr(tx, "step") and hasattr(tx, "init"):
            hint = (
                f" A {type(tx).__name__} returns new params, not updates, so it goes around a "
                f"chain rather than inside one. Fix: mixed_precision(chain(...), ...)."
            )
        elif hasattr(tx, "gradient_transformation"):
            hint = " Fix: pass tx.gradient_transformation() (e.g. for functopt.MultiSteps)."
        elif isinstance(tx, type) or (callable(tx) and not isinstance(tx, tuple)):
            name = getattr(tx, "__name__", type(tx).__name__)
            hint = (
                f" It is callable ({name}): did you pass the factory instead of calling it? "
                f"Fix: pass {name}(...), as in scale_by_adam() or adam(1e-3), not adam."
            )
        elif isinstance(tx, tuple) and len(tx) == 2 and all(map(callable, tx)):
            hint = " Fix: wrap the pair as functopt.GradientTransformation(init_fn, update_fn)."
        else:
            hint = " Fix: build it with a functopt transform factory, e.g. functopt.scale(-0.1)."
        raise TypeError(
            f"{owner}: {where} must be a functopt.GradientTransformation, got "
            f"{type(tx).__name__}.{hint}"
        )
    return with_extra_args_support(tx)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply transforms one after another; the state is the tuple of their states.

    ``chain(a, b).update(g, (sa, sb), params)`` feeds ``a``'s output updates into ``b``; every
    transform sees the same ``params`` and extra arguments. ``chain()`` is the identity, and
    chains nest associatively in their updates (``chain(a, chain(b, c))`` computes what
    ``chain(a, b, c)`` does; only the nesting of the state tuple differs).

    Transforms whose ``update`` does not take ``**extra_args`` are wrapped with
    [`with_extra_args_support`][functopt.with_extra_args_support], so extra arguments given to the chain reach
    the transforms that accept them and are dropped for the others.

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.chain(functopt.scale_by_adam(), functopt.scale(-0.1))
        >>> state = tx.init({"w": torch.zeros(2)})
        >>> tx.update({"w": torch.tensor([4.0, 0.2])}, state)[0]  # first Adam step: sign(g)
        {'w': tensor([-0.1000, -0.1000])}
    """
    txs = tuple(_check_transform("chain", f"argument {i}", tx) for i, tx in enumerate(transforms))

    def init_fn(params: Params) -> tuple[State, ...]:
        return tuple(tx.init(params) for tx in txs)

    def update_fn(
        updates: Updates, state: tuple[State, ...], params: Params | None = None,
        **extra_args: Any,
    ) -> tuple[Updates, tuple[State, ...]]:
        if not isinstance(state, (tuple, list)) or len(state) != len(txs):
            got = f"a {type(state).__name__}" + (
                f" of length {len(state)}" if isinstance(state, (tuple, list)) else ""
            )
            # Not a tuple at all (a NamedTuple is one: it is refused by its element's check).
            error = ValueError if isinstance(state, (tuple, list)) else TypeError
            raise error(
                f"chain of {len(txs)} transforms expects a tuple of {len(txs)} states, got "
                f"{got}. Fix: pass the state returned by this chain's init/update."
            )
        new_states = []
        for tx, s in zip(txs, state, strict=True):
            updates, s = tx.update(updates, s, params, **extra_args)
            new_states.append(s)
        return updates, tuple(new_states)

    return specified(GradientTransformation(init_fn, update_fn),
                     Sequence(tuple(describe(tx) for tx in txs)))


def named_chain(*transforms: tuple[str, GradientTransformation]) -> GradientTransformation:
    """Like [`chain`][functopt.chain], but the state is a dict keyed by the given names.

    Names make states readable and addressable (``state["adam"].count``), and keep
    checkpoints stable when a chain is edited.

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.named_chain(("adam", functopt.scale_by_adam()), ("lr", functopt.scale(-0.1)))
        >>> state = tx.init({"w": torch.zeros(1)})
        >>> sorted(state)
        ['adam', 'lr']
        >>> updates, state = tx.update({"w": torch.ones(1)}, state)
        >>> state["adam"].count
        tensor(1, dtype=torch.int32)
    """
    names: list[str] = []
    txs: list[GradientTransformation] = []
    for i, item in enumerate(transforms):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            hint = (
                " It is a transform without a name."
                if isinstance(item, GradientTransformation) else ""
            )
            raise TypeError(
                f"named_chain: argument {i} must be a (name, transform) pair with a str name, "
                f"got {type(item).__name__}.{hint} Fix: named_chain(('adam', scale_by_adam()), "
                f"('lr', scale(-0.1)))."
            )
        name, tx = item
        if name in names:
            raise ValueError(
                f"named_chain: the name {name!r} is used twice (arguments {names.index(name)} "
                f"and {i}); names key the state dict, so they must be unique. Fix: rename one."
            )
        names.append(name)
        txs.append(_check_transform("named_chain", f"transform {name!r}", tx))

    def init_fn(params: Params) -> dict[str, State]:
        return {name: tx.init(params) for name, tx in zip(names, txs, strict=True)}

    def update_fn(
        updates: Updates, state: dict[str, State], params: Params | None = None,
        **extra_args: Any,
    ) -> tuple[Updates, dict[str, State]]:
        if not isinstance(state, dict) or set(state) != set(names):
            got = (
                f"a dict with keys {list(state)}" if isinstance(state, dict)
                else f"a {type(state).__name__}"
            )
            raise (ValueError if isinstance(state, dict) else TypeError)(
                f"named_chain expects a state dict with keys {names}, got {got}. "
                f"Fix: pass the state returned by this chain's init/update."
            )
        new_state = {}
        for name, tx in zip(names, txs, strict=True):
            updates, new_state[name] = tx.update(updates, state[name], params, **extra_args)
        return updates, new_state

    return specified(GradientTransformation(init_fn, update_fn),
                     Sequence(tuple(describe(tx) for tx in txs), tuple(names)))


