"""Building and running the transform a conformance check is given (private).

Used by [`functopt.testing.conformance`][functopt.testing.conformance] and its fast-path
laws (``functopt/testing/_fast.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import functopt
from functopt._base import GradientTransformation

TransformOrFactory = GradientTransformation | Callable[[], GradientTransformation]
"""A transform, or a zero-argument function that builds one (``lambda: functopt.adam(1e-3)``).

Give a factory where you can: checks that compare runs build a fresh transform per run."""


def build(tx: Any, owner: str) -> GradientTransformation:
    """The transform itself, or what the factory returns (duck-typed ``init``/``update``)."""
    if not is_transform(tx):
        if not callable(tx):
            raise TypeError(
                f"{owner}: expected a GradientTransformation or a zero-argument factory "
                f"returning one, got {type(tx).__name__}."
            )
        tx = tx()
        if not is_transform(tx):
            raise TypeError(
                f"{owner}: the factory returned {type(tx).__name__}, not a "
                f"GradientTransformation. Fix: pass `lambda: my_transform(...)`."
            )
    if isinstance(tx, GradientTransformation):
        return tx
    if isinstance(tx, functopt.MultiSteps):  # (its spec comes with gradient_transformation)
        return tx.gradient_transformation()
    return GradientTransformation(tx.init, tx.update)


def is_transform(tx: Any) -> bool:
    return isinstance(tx, GradientTransformation) or (
        not isinstance(tx, type) and callable(getattr(tx, "init", None))
        and callable(getattr(tx, "update", None))
    )


def run_steps(
    tx: GradientTransformation, params: Any, grads: Any, steps: int, with_params: bool,
    extra_args: Mapping[str, Any] | None,
) -> tuple[Any, list[tuple[Any, Any]]]:
    """``init`` then ``steps`` updates on the same grads: ``(state0, [(updates, state), ...])``."""
    state = tx.init(params)
    state0 = state
    out = []
    for _ in range(steps):
        updates, state = tx.update(grads, state, params if with_params else None,
                                   **(extra_args or {}))
        out.append((updates, state))
    return state0, out
