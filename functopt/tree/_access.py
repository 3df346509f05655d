"""Reading and replacing fields by name anywhere in a nested state: ``get`` and ``set``.

Optimizer states are nests of NamedTuples, dicts and tuples (``chain`` of ``inject_hyperparams``
of ...). These two functions find a field by its name, wherever it sits: a NamedTuple field,
a dict key, or the class name of a NamedTuple (``'ScaleByAdamState'``), like
``optax.tree.get`` / ``optax.tree.set``.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Mapping
from typing import Any

import optree

from functopt.tree import _core

__all__ = ["get", "set"]

_MISSING: Any = object()


class _TreeKeyError(KeyError):
    """A ``KeyError`` whose message prints as written (``KeyError`` would quote it)."""

    def __str__(self) -> str:
        return str(self.args[0])


def _is_namedtuple(node: Any) -> bool:
    return isinstance(node, tuple) and hasattr(node, "_fields")


def _children(node: Any) -> tuple[list[Any], list[Any], Any, Any] | None:
    """``(children, names, metadata, unflatten)`` of a container node, None for a leaf."""
    try:
        children, metadata, entries, unflatten = optree.tree_flatten_one_level(
            node, none_is_leaf=True, namespace=_core.NAMESPACE
        )
    except ValueError:
        return None
    names = list(node._fields) if _is_namedtuple(node) else list(entries)
    return list(children), names, metadata, unflatten


def _join(path: str, name: Any) -> str:
    return str(name) if path == "<root>" else f"{path}.{name}"


def _walk(node: Any, path: str = "<root>") -> Iterator[tuple[str, Any, Any]]:
    """Every named place of the tree: ``(path, name, value)``, outermost first.

    Names are NamedTuple fields and dict keys (with the value they hold) and NamedTuple
    class names (with the NamedTuple itself).
    """
    if _is_namedtuple(node):
        yield path, type(node).__name__, node
    parts = _children(node)
    if parts is None:
        return
    children, names, _, _ = parts
    named = _is_namedtuple(node) or isinstance(node, Mapping)
    for name, child in zip(names, children, strict=True):
        child_path = _join(path, name)
        if named:
            yield child_path, name, child
        yield from _walk(child, child_path)


def _not_found(owner: str, key: Any, tree: Any) -> _TreeKeyError:
    names = sorted({str(name) for _, name, _ in _walk(tree)})
    close = difflib.get_close_matches(str(key), names, n=3)
    hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
    listing = ", ".join(map(repr, names)) if names else "none (the tree has no named fields)"
    return _TreeKeyError(
        f"functopt.tree.{owner}: no field, dict key or NamedTuple named {key!r} in the tree. "
        f"Names found: {listing}.{hint}"
    )


def get(tree: Any, key: Any, default: Any = _MISSING) -> Any:
    """The value of the one field named ``key`` anywhere in ``tree``.

    ``key`` matches a NamedTuple field, a dict key, or the class name of a NamedTuple (which
    returns the NamedTuple itself), at any depth. Exactly one place must match: a name found
    at several paths is an error that lists them (call ``get`` on the subtree that holds
    the one you want, such as one transform's state of a chain).

    Args:
        tree: the tree to search, typically an optimizer state.
        key: the name to look for.
        default: returned when nothing matches. Without it, a missing name is an error.

    Returns:
        The matching value (a leaf or a subtree).

    Raises:
        KeyError: ``key`` matches several places (paths listed), or none and no ``default``
            was given (the names that do exist listed).

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.chain(functopt.scale_by_adam(), functopt.scale(-0.1))
        >>> state = tx.init({"w": torch.zeros(2)})
        >>> functopt.tree.get(state, "count")
        tensor(0, dtype=torch.int32)
        >>> functopt.tree.get(state, "lr", default=None) is None
        True
    """
    found = [(path, value) for path, name, value in _walk(tree) if name == key]
    if len(found) > 1:
        paths = ", ".join(repr(path) for path, _ in found)
        raise _TreeKeyError(
            f"functopt.tree.get: {key!r} is ambiguous: it is found at {len(found)} places: "
            f"{paths}. Fix: call get on the subtree that holds the one you want (for example "
            f"one transform's state of a chain, or name the transforms with named_chain)."
        )
    if found:
        return found[0][1]
    if default is not _MISSING:
        return default
    raise _not_found("get", key, tree)


def set(tree: Any, **values: Any) -> Any:
    """A copy of ``tree`` with every field named like a keyword replaced by its value.

    Names match as in [`get`][functopt.tree.get] (NamedTuple fields, dict keys, NamedTuple class names), at
    any depth, and every match is replaced (``set(state, count=...)`` resets the counter of
    each transform of a chain). Nothing is mutated: containers on the way are rebuilt, and
    the rest of the tree is shared with the input.

    Args:
        tree: the tree to edit, typically an optimizer state.
        **values: ``name=new_value`` pairs.

    Returns:
        A tree like ``tree`` with the values replaced.

    Raises:
        KeyError: a name matches nothing in ``tree`` (the names that do exist listed).

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.scale_by_adam()
        >>> state = tx.init({"w": torch.zeros(2)})
        >>> state = functopt.tree.set(state, count=torch.tensor(10, dtype=torch.int32))
        >>> state.count
        tensor(10, dtype=torch.int32)
    """
    if not values:
        return tree
    present = {name for _, name, _ in _walk(tree)}
    for key in values:
        if key not in present:
            raise _not_found("set", key, tree)
    return _replace(tree, values)


def _replace(node: Any, values: dict[str, Any]) -> Any:
    if _is_namedtuple(node) and type(node).__name__ in values:
        return values[type(node).__name__]
    parts = _children(node)
    if parts is None:
        return node
    children, names, metadata, unflatten = parts
    named = _is_namedtuple(node) or isinstance(node, Mapping)
    new = [
        values[name] if named and name in values else _replace(child, values)
        for name, child in zip(names, children, strict=True)
    ]
    if all(a is b for a, b in zip(new, children, strict=True)):
        return node  # nothing to replace below: share the subtree
    return unflatten(metadata, new)
