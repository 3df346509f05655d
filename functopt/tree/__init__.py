"""Pytree utilities over optree, in functopt's conventions (``None`` is a leaf).

Every function here flattens with ``none_is_leaf=True`` in the private ``"functopt"``
namespace, and names leaves by dotted paths such as ``'layers.3.weight'``. A ``None`` leaf
(a parameter without a gradient, or its state) stays ``None``: maps skip it, reductions
leave it out. The short names follow ``optax.tree`` (``get``, ``set``, ``cast``,
``zeros_like``, ``sum``, ``vdot``, ...); ``map``, ``sum`` and ``set`` shadow builtins only
inside this namespace (use them as ``functopt.tree.map``).
"""

from functopt.tree._access import get, set
from functopt.tree._core import NAMESPACE, flatten, leaves_with_path, structure, unflatten
from functopt.tree._ops import (
    cast,
    full_like,
    global_norm,
    map,
    map_with_path,
    ones_like,
    sum,
    vdot,
    zeros_like,
)

__all__ = [
    "NAMESPACE",
    "cast",
    "flatten",
    "full_like",
    "get",
    "global_norm",
    "leaves_with_path",
    "map",
    "map_with_path",
    "ones_like",
    "set",
    "structure",
    "sum",
    "unflatten",
    "vdot",
    "zeros_like",
]
