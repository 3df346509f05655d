"""Hyperparameter checks shared by every factory.

Factories check Python numbers when the transform is built, so that a bad value fails at
construction with the value in the message. Tensor hyperparameters (as passed by
``inject_hyperparams`` or by a user differentiating through them) are trusted: reading their
value would need a host sync, and under ``torch.func`` it may not exist at all.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_number(owner: str, name: str, value: Any, *, allow_callable: bool = False) -> None:
    """Raise ``TypeError`` unless ``value`` is a number, a 0-d tensor (or a schedule if allowed)."""
    if _is_number(value) or isinstance(value, torch.Tensor):
        if isinstance(value, torch.Tensor) and value.dim() != 0:
            # A vector where a scalar belongs is a value of the wrong kind, as a schedule
            # that returns one is (TypeError), not a scalar out of range.
            raise TypeError(
                f"{owner}: {name} must be a number or a 0-d tensor, got a tensor of shape "
                f"{tuple(value.shape)}. Fix: pass a scalar (use .reshape(()) on a 1-element tensor)."
            )
        return
    if allow_callable and callable(value):
        return
    expected = "a number, a 0-d tensor or a schedule (step -> value)" if allow_callable else (
        "a number or a 0-d tensor"
    )
    raise TypeError(f"{owner}: {name} must be {expected}, got {type(value).__name__} {value!r}.")


def check_range(
    owner: str,
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    allow_callable: bool = False,
    hint: str = "",
) -> None:
    """Check that a hyperparameter lies in an interval; the message shows the interval."""
    check_number(owner, name, value, allow_callable=allow_callable)
    if not _is_number(value):
        return
    bad = math.isnan(value)
    if low is not None:
        bad = bad or value < low or (low_open and value == low)
    if high is not None:
        bad = bad or value > high or (high_open and value == high)
    if bad:
        lo = "(-inf" if low is None else ("(" if low_open else "[") + f"{low:g}"
        hi = "inf)" if high is None else f"{high:g}" + (")" if high_open else "]")
        fix = f" {hint}" if hint else ""
        raise ValueError(f"{owner}: {name} must be in {lo}, {hi}, got {value!r}.{fix}")


def check_dtype(owner: str, name: str, value: Any) -> None:
    """``None`` or a floating torch dtype."""
    if value is None:
        return
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise TypeError(
            f"{owner}: {name} must be None or a floating torch.dtype (e.g. torch.bfloat16), "
            f"got {value!r}."
        )


STATE_TYPE_MISMATCH = (
    "{owner}: state must be the {expected} that {owner}'s init and update return, got "
    "{got}. A state is refused by its type, not accepted because its field names match: "
    "a state from another transform (lion's for adamw, sgd's for adam) would be misread. "
    "Fix: pass the state returned by this transform's init(params) or by its last update "
    "(for a recipe or chain: the state from its own init, whose entries follow the "
    "transforms in order)."
)


def describe_state(state: Any) -> str:
    """``a ScaleByAdamState (fields count, mu, nu)``, ``a tuple of 2``, ``None``."""
    if state is None:
        return "None"
    name = type(state).__name__
    article = "an" if name[:1].lower() in "aeiou" else "a"
    fields = getattr(type(state), "_fields", None)
    if isinstance(state, tuple) and fields is not None:
        return f"{article} {name} (fields {', '.join(fields) or 'none'})"
    if isinstance(state, (tuple, list, dict)):
        return f"{article} {name} of {len(state)}"
    return f"{article} {name}"


def check_state(owner: str, state: Any, expected: type) -> None:
    """Raise ``TypeError`` (``STATE_TYPE_MISMATCH``) unless ``state`` is an ``expected``.

    A field-less ``expected`` (``EmptyState``) also takes ``None`` and ``()``, as optax's
    stateless transforms do; a state that carries fields never passes for it."""
    if not getattr(expected, "_fields", True) and (
            state is None or (isinstance(state, tuple) and len(state) == 0)):
        return  # a stateless transform: no state in any spelling (None, (), EmptyState())
    if not isinstance(state, expected):
        raise TypeError(STATE_TYPE_MISMATCH.format(
            owner=owner, expected=expected.__name__, got=describe_state(state)))


FLAG_NOT_BOOL = (
    "{owner}: {name} must be True or False, got {got}. An option that chooses what the "
    "transform computes is not read by truthiness: a string, a number or a tensor there is a "
    "mistake (an argument in the wrong place, a misspelled keyword). Fix: pass {name}=True "
    "or {name}=False."
)


def check_flags(owner: str, **flags: Any) -> None:
    """Raise ``TypeError`` (``FLAG_NOT_BOOL``) unless every keyword value is a ``bool``."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            got = (f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
                   else f"{type(value).__name__} {value!r}")
            raise TypeError(FLAG_NOT_BOOL.format(owner=owner, name=name, got=got))
