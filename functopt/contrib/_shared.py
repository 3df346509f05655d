"""What the contrib transforms share beyond ``functopt.transforms._common`` (private)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from functopt import _validate
from functopt.transforms import _common


def value_at(hyperparameter: Any, count: torch.Tensor) -> Any:
    """``hyperparameter(count)`` for a schedule, else the hyperparameter itself."""
    if callable(hyperparameter) and not isinstance(hyperparameter, torch.Tensor):
        return hyperparameter(count)
    return hyperparameter


def scalar_dtype(leaves: Sequence[Any]) -> torch.dtype:
    """The dtype of a transform's tree-wide scalars (distance estimates, averaging weights).

    The widest of the params' dtypes and float32: optax keeps them in the *lowest* param
    dtype, which for bfloat16 params would leave a distance estimate three significant
    digits; for float32 and float64 trees the two rules agree.
    """
    return _common.compute_dtype(*(p.dtype for p in leaves if p is not None))


def zeros(treespec: Any, leaves: Sequence[Any], dtype: torch.dtype | None = None) -> Any:
    """A new tree of zeros like the params (``leaves`` of ``treespec``; None where a param
    is None), in ``dtype`` or each param's. Call it once per state field: a donated fast
    step writes each state entry in place, so two fields must never share a tensor."""
    return _common.unflatten(
        treespec, [None if p is None else _common.zeros_like(p, dtype) for p in leaves])


def f64(value: Any, device: torch.device) -> torch.Tensor:
    """A number or a 0-d tensor as a 0-d float64 tensor on ``device`` (for scalar maths)."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=torch.float64)
    return torch.tensor(value, dtype=torch.float64, device=device)


def check_lr(owner: str, learning_rate: Any) -> None:
    _validate.check_range(owner, "learning_rate", learning_rate, low=0.0, allow_callable=True,
                          hint="Fix: pass a non-negative learning rate; the recipe descends.")


def check_betas_pair(owner: str, betas: Any) -> tuple[Any, Any]:
    """``betas`` as optax's prodigy / dadapt_adamw take it: a pair (b1, b2) in [0, 1)."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(
            f"{owner}: betas must be a pair (beta1, beta2), got {betas!r}. "
            f"Fix: pass betas=(0.9, 0.999)."
        )
    _common.check_betas(owner, **{"betas[0]": betas[0], "betas[1]": betas[1]})
    return betas[0], betas[1]


def map_with_params(fn: Any, grads: list[Any], params: list[Any],
                     *states: list[Any]) -> tuple[list[Any], ...]:
    """``map_with_state`` with the params as a read-only second argument (passed through)."""
    def with_params(g: torch.Tensor, p: torch.Tensor, *leaf_states: Any) -> tuple[Any, ...]:
        u, *new = fn(g, p, *leaf_states)
        return (u, p, *new)

    return _common.map_with_state(with_params, grads, params, *states)
