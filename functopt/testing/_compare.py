"""Bitwise comparison of pytrees, and snapshots that detect mutation (private).

Used by [`functopt.testing.conformance`][functopt.testing.conformance]. Bit patterns are compared through integer
views of the same width: a float comparison would call ``nan != nan`` and
``-0.0 == 0.0``, and both hide real differences.
"""

from __future__ import annotations

from typing import Any

import torch

from functopt.fast._layout import overlapping
from functopt.tree import _core

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(x: torch.Tensor) -> torch.Tensor:
    if x.is_complex():
        x = torch.view_as_real(x.resolve_conj())
    if x.is_floating_point():
        return x.view(_INT_OF_SIZE[x.element_size()])
    return x


def _value(x: torch.Tensor, index: tuple[int, ...]) -> Any:
    return x.detach()[index].cpu().item()


def tensor_difference(actual: torch.Tensor, expected: torch.Tensor) -> str | None:
    """``None`` if bitwise equal (with dtype, shape and device), else what differs."""
    if actual.dtype != expected.dtype:
        return f"dtype {_core._dtype_name(actual.dtype)} vs {_core._dtype_name(expected.dtype)}"
    if actual.shape != expected.shape:
        return f"shape {tuple(actual.shape)} vs {tuple(expected.shape)}"
    if actual.device != expected.device:
        return f"device {actual.device} vs {expected.device}"
    a, e = _bits(actual.detach()), _bits(expected.detach())
    if torch.equal(a, e):
        return None
    differ = a != e
    if differ.dim() > actual.dim():  # complex: the real/imaginary axis was appended
        differ = differ.any(-1)
    first = tuple(int(i) for i in differ.nonzero()[0])
    return (
        f"{int(differ.sum())} of {actual.numel()} elements differ bitwise; first at index "
        f"{first}: {_value(actual, first)!r} vs {_value(expected, first)!r}"
    )


def leaf_difference(actual: Any, expected: Any) -> str | None:
    """``None`` if two leaves are equal (tensors: bitwise), else what differs."""
    if isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor):
        return tensor_difference(actual, expected)
    if isinstance(actual, torch.Tensor) or isinstance(expected, torch.Tensor):
        return f"{_core._describe(actual)} vs {_core._describe(expected)}"
    if type(actual) is not type(expected):
        return f"{type(actual).__name__} vs {type(expected).__name__}"
    try:
        same = bool(actual == expected)
    except Exception:  # an object whose == is not a truth value
        same = actual is expected
    return None if same else f"{actual!r} vs {expected!r}"


def assert_trees_equal(
    actual: Any, expected: Any, *, check: str, what: str, fix: str = ""
) -> None:
    """Bitwise equality of two trees; ``what`` reads as '<actual> vs <expected>'."""
    a_leaves, a_spec = _core.flatten(actual)
    e_leaves, e_spec = _core.flatten(expected)
    if a_spec != e_spec:
        where = _core._first_difference(expected, actual, "<root>")
        raise AssertionError(f"{check}: {what}: the trees have different structures ({where})."
                             f"{fix}")
    for path, a, e in zip(_core.paths(e_spec), a_leaves, e_leaves, strict=True):
        difference = leaf_difference(a, e)
        if difference is not None:
            raise AssertionError(f"{check}: {what}: leaf {path!r}: {difference}.{fix}")


def _version(x: torch.Tensor) -> int | None:
    try:
        return int(x._version)
    except RuntimeError:  # inference tensors have no version counter
        return None


class Snapshot:
    """Copies of trees handed to or returned by a transform, to detect later mutation."""

    def __init__(self) -> None:
        self._trees: list[tuple[str, Any, _core.TreeSpec, list[Any], list[Any]]] = []

    def add(self, label: str, tree: Any) -> None:
        """Remember ``tree`` (called ``label`` in messages): containers, leaves, values."""
        leaves, spec = _core.flatten(tree)
        saved = [
            (leaf.detach().clone(), _version(leaf)) if isinstance(leaf, torch.Tensor) else None
            for leaf in leaves
        ]
        self._trees.append((label, tree, spec, list(leaves), saved))

    def verify(self, call: str) -> None:
        """Raise ``AssertionError`` if ``call`` changed any tree remembered so far."""
        fix = (" Fix: compute new tensors out of place (x = x * c, not x.mul_(c); no "
               "out=..., no .data writes) and build new containers instead of editing the "
               "ones you were given.")
        for label, tree, spec, leaves, saved in self._trees:
            now_leaves, now_spec = _core.flatten(tree)
            if now_spec != spec:
                where = _core._first_difference(_core.unflatten(spec, leaves), tree, "<root>")
                raise AssertionError(
                    f"check_purity: {call} edited the containers of {label} in place ({where})."
                    f"{fix}"
                )
            for path, before, now, copy in zip(_core.paths(spec), leaves, now_leaves, saved,
                                               strict=True):
                if now is not before:
                    raise AssertionError(
                        f"check_purity: {call} replaced leaf {path!r} of {label} by another "
                        f"object (its container was edited in place).{fix}"
                    )
                if copy is None:
                    continue
                clone, version = copy
                new_version = _version(now)
                difference = tensor_difference(now, clone)
                if version != new_version:
                    values = "" if difference is None else f"; {difference} (now vs before)"
                    raise AssertionError(
                        f"check_purity: {call} mutated leaf {path!r} of {label} in place: its "
                        f"version counter moved from {version} to {new_version}{values}.{fix}"
                    )
                if difference is not None:
                    raise AssertionError(
                        f"check_purity: {call} changed the values of leaf {path!r} of {label}: "
                        f"{difference} (now vs before).{fix}"
                    )


def clone_tree(tree: Any) -> Any:
    """A copy of ``tree`` whose tensor leaves are clones (to compare against later), with
    their strides (a sliced leaf stays a strided view of a larger buffer) and their ties
    (a tensor at two places of the tree is cloned once, the clone placed at both).

    Examples:
        >>> import torch
        >>> from functopt.testing import bitwise_equal, clone_tree
        >>> tree = {"w": torch.ones(2), "b": None}
        >>> copy = clone_tree(tree)
        >>> copy["w"] is tree["w"], bitwise_equal(copy, tree)
        (False, True)
    """
    leaves, spec = _core.flatten(tree)
    clones: dict[int, torch.Tensor] = {}
    out = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            if id(x) not in clones:
                clones[id(x)] = _clone_strided(x)
            x = clones[id(x)]
        out.append(x)
    return _core.unflatten(spec, out)


def _clone_strided(x: torch.Tensor) -> torch.Tensor:
    """``x.clone()``, keeping the strides of a leaf that is not dense (clone makes it
    contiguous); an overlapping (expanded) one is cloned as clone does."""
    copy = x.clone()
    if copy.stride() == x.stride() or x.numel() <= 1 or overlapping(x):
        return copy
    out = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
    with torch.no_grad():
        out.copy_(x)
    return out.requires_grad_(x.requires_grad)


def bitwise_equal(actual: Any, expected: Any) -> bool:
    """Whether two trees have the same structure and bitwise-equal leaves.

    Tensors compare by dtype, shape, device and bit pattern (so ``nan`` equals the same
    ``nan`` and ``-0.0`` differs from ``0.0``); other leaves by ``==``.

    Examples:
        >>> import torch
        >>> from functopt.testing import bitwise_equal
        >>> nan = torch.tensor([float("nan")])
        >>> bitwise_equal({"a": nan}, {"a": nan.clone()}), bitwise_equal([torch.tensor(0.0)], [torch.tensor(-0.0)])
        (True, False)
    """
    a_leaves, a_spec = _core.flatten(actual)
    e_leaves, e_spec = _core.flatten(expected)
    if a_spec != e_spec:
        return False
    return all(leaf_difference(a, e) is None for a, e in zip(a_leaves, e_leaves, strict=True))


def assert_bitwise_equal(actual: Any, expected: Any, *, what: str = "trees") -> None:
    """Raise ``AssertionError`` naming the first leaf (by path) where the trees differ.

    Examples:
        >>> import torch
        >>> from functopt.testing import assert_bitwise_equal
        >>> assert_bitwise_equal({"w": torch.zeros(1)}, {"w": torch.zeros(1)})
        >>> try:
        ...     assert_bitwise_equal({"w": torch.zeros(1)}, {"w": -torch.zeros(1)})
        ... except AssertionError as error:
        ...     print("'w'" in str(error))
        True
    """
    assert_trees_equal(actual, expected, check="assert_bitwise_equal", what=what)
