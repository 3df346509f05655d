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

__all__ = [
    "chain",
    "named_chain",
]


def _check_transform(owner: str, where: str, tx: Any) -> GradientTransformation:
    if not isinstance(tx, GradientTransformation):
        hint = ""
        if callable(tx):
            hint = " It is callable: did you pass the factory instead of calling it (adam vs adam(1e-3))?"
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

    Example:
        >>> import torch, functopt
        >>> tx = functopt.chain(functopt.clip(1.0), functopt.scale(-0.5))
        >>> tx.update({"w": torch.tensor([4.0, 0.2])}, tx.init({"w": torch.zeros(2)}))[0]
        {'w': tensor([-0.5000, -0.1000])}
    """
    txs = tuple(_check_transform("chain", f"argument {i}", tx) for i, tx in enumerate(transforms))

    def init_fn(params: Params) -> tuple[State, ...]:
        return tuple(tx.init(params) for tx in txs)

    def update_fn(
        updates: Updates, state: tuple[State, ...], params: Params | None = None,
        **extra_args: Any,
    ) -> tuple[Updates, tuple[State, ...]]:
        if not isinstance(state, tuple) or len(state) != len(txs):
            got = f"a {type(state).__name__}" + (
                f" of length {len(state)}" if isinstance(state, tuple) else ""
            )
            raise ValueError(
                f"chain of {len(txs)} transforms expects a tuple of {len(txs)} states, got "
                f"{got}. Fix: pass the state returned by this chain's init/update."
            )
        new_states = []
        for tx, s in zip(txs, state, strict=True):
            updates, s = tx.update(updates, s, params, **extra_args)
            new_states.append(s)
        return updates, tuple(new_states)

    return GradientTransformation(init_fn, update_fn)


def named_chain(*transforms: tuple[str, GradientTransformation]) -> GradientTransformation:
    """Like :func:`chain`, but the state is a dict keyed by the given names.

    Names make states readable and addressable (``state["clip"]``,
    ``functopt.tree.get(state, "count")``), and keep checkpoints stable when a chain is
    edited.

    Example:
        >>> import torch, functopt
        >>> tx = functopt.named_chain(("clip", functopt.clip(1.0)), ("lr", functopt.scale(-0.1)))
        >>> sorted(tx.init({"w": torch.zeros(1)}))
        ['clip', 'lr']
    """
    names: list[str] = []
    txs: list[GradientTransformation] = []
    for i, item in enumerate(transforms):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(
                f"named_chain: argument {i} must be a (name, transform) pair, got "
                f"{type(item).__name__}. Fix: named_chain(('clip', clip(1.0)), ...)."
            )
        name, tx = item
        if name in names:
            raise ValueError(f"named_chain: the name {name!r} is used twice; names must be unique.")
        names.append(name)
        txs.append(_check_transform("named_chain", f"transform {name!r}", tx))

    def init_fn(params: Params) -> dict[str, State]:
        return {name: tx.init(params) for name, tx in zip(names, txs, strict=True)}

    def update_fn(
        updates: Updates, state: dict[str, State], params: Params | None = None,
        **extra_args: Any,
    ) -> tuple[Updates, dict[str, State]]:
        if not isinstance(state, dict) or sorted(state) != sorted(names):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"named_chain expects a state dict with keys {sorted(names)}, got {got}. "
                f"Fix: pass the state returned by this chain's init/update."
            )
        new_state = {}
        for name, tx in zip(names, txs, strict=True):
            updates, new_state[name] = tx.update(updates, state[name], params, **extra_args)
        return updates, new_state

    return GradientTransformation(init_fn, update_fn)


