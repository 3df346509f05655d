"""Pytree utilities over optree, in functopt's conventions (``None`` is a leaf).

Every function here flattens with ``none_is_leaf=True`` in the private ``"functopt"``
namespace, and names leaves by dotted paths such as ``'layers.3.weight'``.
"""

from functopt.tree._core import NAMESPACE, flatten, leaves_with_path, structure, unflatten
from functopt.tree._ops import global_norm

__all__ = [
    "NAMESPACE",
    "flatten",
    "global_norm",
    "leaves_with_path",
    "structure",
    "unflatten",
]
