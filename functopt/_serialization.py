"""Loading saved states with ``torch.load(..., weights_only=True)``, PyTorch's default.

A functopt state is a pytree of tensors inside NamedTuples (``ScaleByAdamState``,
``EmptyState``, ...). ``torch.save`` writes them as they are, and the default
``torch.load`` (``weights_only=True`` since PyTorch 2.6) refuses any class it has not been
told is safe. [`state_classes`][functopt.state_classes] lists functopt's NamedTuple
classes (plain data: fields of tensors, numbers and trees, no code runs when they are
built), and [`safe_globals`][functopt.safe_globals] allows them for one ``torch.load``,
without turning ``weights_only`` off (which would let a checkpoint run arbitrary code).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

# Imported for their state classes: everything the package defines is loaded before the
# module table is read.
import functopt.adapters
import functopt.contrib
import functopt.distributed
import functopt.precision  # noqa: F401

__all__ = ["safe_globals", "state_classes"]


def _is_namedtuple_class(obj: Any) -> bool:
    return (isinstance(obj, type) and issubclass(obj, tuple)
            and isinstance(getattr(obj, "_fields", None), tuple))


def state_classes() -> list[type]:
    """Every NamedTuple class functopt defines (the states and what they hold), by name.

    For ``torch.serialization.add_safe_globals(functopt.state_classes())``, which allows
    them in every later ``torch.load`` of the process; [`safe_globals`][functopt.safe_globals]
    allows them for one block instead.

    Examples:
        >>> import functopt
        >>> names = [cls.__name__ for cls in functopt.state_classes()]
        >>> "ScaleByAdamState" in names and "EmptyState" in names and "MixedPrecisionState" in names
        True
    """
    found: dict[str, type] = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "functopt" or name.startswith("functopt.")):
            continue
        for obj in vars(module).values():
            if _is_namedtuple_class(obj) and obj.__module__.startswith("functopt"):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return [found[key] for key in sorted(found)]


def safe_globals() -> Any:
    """A context manager in which ``torch.load`` (``weights_only=True``) accepts functopt states.

    ``torch.serialization.safe_globals(functopt.state_classes())``: inside the block the
    default, safe ``torch.load`` reads a state saved with ``torch.save``; outside it,
    PyTorch raises ``UnpicklingError`` naming the class (``ScaleByAdamState``). The state
    classes hold only data, so this keeps the guarantee of ``weights_only`` that loading a
    file runs no code from it.

    Examples:
        >>> import io, torch, functopt
        >>> params = {"w": torch.zeros(2)}
        >>> state = functopt.adamw(1e-3).init(params)
        >>> buffer = io.BytesIO()
        >>> torch.save(state, buffer)
        >>> _ = buffer.seek(0)
        >>> with functopt.safe_globals():
        ...     loaded = torch.load(buffer)  # weights_only=True, PyTorch's default
        >>> type(loaded[0]).__name__, bool(loaded[0].mu["w"].eq(0).all())
        ('ScaleByAdamState', True)
    """
    allowed: list[Callable[..., Any] | tuple[Callable[..., Any], str]] = list(state_classes())
    return torch.serialization.safe_globals(allowed)
