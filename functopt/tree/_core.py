"""Flattening, paths and structure checks shared by every layer of functopt.

Every pytree in functopt is flattened the same way: optree with ``none_is_leaf=True`` (so a
``None`` gradient keeps its place next to the parameter it belongs to) in the private
``"functopt"`` namespace (so custom nodes registered for functopt do not leak into other
libraries). Transforms flatten the updates once per call and line every other tree up
against the updates' treespec with ``flatten_up_to``, which is about ten times cheaper than a
fresh flatten; the path-aware (slow) code runs only to build an error message.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import optree
import torch

NAMESPACE = "functopt"

Tree = Any
TreeSpec = optree.PyTreeSpec


def flatten(tree: Tree) -> tuple[list[Any], TreeSpec]:
    """Flatten ``tree`` into its leaves (``None`` counts as a leaf) and its treespec.

    Examples:
        >>> from functopt import tree
        >>> leaves, treespec = tree.flatten({"b": [1, None], "a": 2})
        >>> leaves, treespec.num_leaves  # dict keys sorted; None is a leaf
        ([2, 1, None], 3)
    """
    return optree.tree_flatten(tree, none_is_leaf=True, namespace=NAMESPACE)


def unflatten(treespec: TreeSpec, leaves: Sequence[Any]) -> Tree:
    """Rebuild a tree of ``treespec``'s structure from ``leaves``.

    Examples:
        >>> from functopt import tree
        >>> leaves, treespec = tree.flatten({"b": [1, None], "a": 2})
        >>> tree.unflatten(treespec, [x if x is None else 10 * x for x in leaves])  # key order kept
        {'b': [10, None], 'a': 20}
    """
    return optree.tree_unflatten(treespec, leaves)


def structure(tree: Tree) -> TreeSpec:
    """The treespec of ``tree``, with ``None`` leaves.

    Examples:
        >>> from functopt import tree
        >>> tree.structure({"w": 1, "b": None}) == tree.structure({"w": 5, "b": 7})
        True
        >>> tree.structure({"w": 1, "b": None}).num_leaves
        2
    """
    return optree.tree_structure(tree, none_is_leaf=True, namespace=NAMESPACE)


def path_parts(accessor: Iterable[optree.PyTreeEntry]) -> tuple[str, ...]:
    """A leaf's path as strings: NamedTuple field names, attribute names, keys, positions."""
    parts = []
    for entry in accessor:
        if isinstance(entry, optree.NamedTupleEntry):
            parts.append(str(entry.field))
        elif isinstance(entry, optree.GetAttrEntry):
            parts.append(str(entry.name))
        else:
            parts.append(str(entry.entry))
    return tuple(parts)


def path_str(accessor: Iterable[optree.PyTreeEntry]) -> str:
    """A dotted, human-readable path: ``'layers.3.weight'``, ``'mu.bias'``, ``'0.w'``."""
    parts = path_parts(accessor)
    return ".".join(parts) if parts else "<root>"


def paths(treespec: TreeSpec) -> list[str]:
    """Dotted paths of the leaves of ``treespec``, in leaf order."""
    return [path_str(a) for a in optree.treespec_accessors(treespec)]


def leaves_with_path(tree: Tree) -> list[tuple[str, Any]]:
    """``(dotted path, leaf)`` pairs of ``tree``, in flatten order.

    Examples:
        >>> from functopt import tree
        >>> tree.leaves_with_path({"layers": [{"weight": 1}], "bias": None})
        [('bias', None), ('layers.0.weight', 1)]
    """
    leaves, treespec = flatten(tree)
    return list(zip(paths(treespec), leaves, strict=True))


def _describe(node: Any) -> str:
    if node is None:
        return "None"
    if isinstance(node, torch.Tensor):
        return f"a {_dtype_name(node.dtype)} tensor of shape {tuple(node.shape)}"
    if isinstance(node, dict):
        return f"a dict with keys {sorted(map(str, node))}"
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return f"a {type(node).__name__} with fields {list(node._fields)}"
    if isinstance(node, (list, tuple)):
        return f"a {type(node).__name__} of length {len(node)}"
    return f"a {type(node).__name__}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _first_difference(reference: Tree, other: Tree, path: str) -> str:
    """Walk both trees together and describe the first place where they differ."""
    ref = _children(reference)
    if ref is None:  # a leaf
        return f"at {path!r}"
    ref_children, _, ref_entries = ref
    oth = _children(other)
    if oth is None or type(other) is not type(reference):
        return f"at {path!r}: expected {_describe(reference)}, got {_describe(other)}"
    oth_children, _, oth_entries = oth
    if list(ref_entries) != list(oth_entries):
        if isinstance(reference, dict) and set(reference) != set(other):
            return f"at {path!r}: {_describe_key_difference(reference, other)}"
        return f"at {path!r}: expected {_describe(reference)}, got {_describe(other)}"
    for entry, ref_child, oth_child in zip(ref_entries, ref_children, oth_children, strict=True):
        child_path = str(entry) if path == "<root>" else f"{path}.{entry}"
        ref_child_spec = structure(ref_child)
        try:
            ref_child_spec.flatten_up_to(oth_child)
        except (ValueError, TypeError):
            return _first_difference(ref_child, oth_child, child_path)
    return f"at {path!r}"


def _describe_key_difference(reference: dict[Any, Any], other: dict[Any, Any]) -> str:
    """Name the missing and the unexpected keys of ``other`` (a dict, like ``reference``)."""
    missing = [k for k in reference if k not in other]
    unexpected = [k for k in other if k not in reference]
    parts = []
    if missing:
        parts.append(f"missing key{'s' if len(missing) > 1 else ''} "
                     f"{', '.join(map(repr, sorted(missing, key=str)))}")
    if unexpected:
        parts.append(f"unexpected key{'s' if len(unexpected) > 1 else ''} "
                     f"{', '.join(map(repr, sorted(unexpected, key=str)))}")
    return f"{' and '.join(parts)} (expected keys {sorted(map(str, reference))})"


def _children(node: Any) -> tuple[list[Any], Any, list[Any]] | None:
    if structure(node).is_leaf():
        return None
    children, metadata, entries, _ = optree.tree_flatten_one_level(
        node, none_is_leaf=True, namespace=NAMESPACE
    )
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return list(children), metadata, list(node._fields)
    return list(children), metadata, list(entries)


def flatten_like(treespec: TreeSpec, tree: Tree, *, name: str, reference: str) -> list[Any]:
    """Flatten ``tree`` up to ``treespec`` (taken from the tree called ``reference``).

    Raises:
        ValueError: naming the first path where ``tree`` (called ``name`` in the message)
            departs from the reference structure.
    """
    try:
        return treespec.flatten_up_to(tree)
    except (ValueError, TypeError):
        ref_tree = unflatten(treespec, [None] * treespec.num_leaves)
        where = _first_difference(ref_tree, tree, "<root>")
        raise ValueError(
            f"{name} does not have the structure of {reference} ({where}). "
            f"Fix: build {name} from the same pytree as {reference}, for example with "
            f"`init(params)` on the params you update, and pass None (not a missing key) "
            f"for a leaf that has no value."
        ) from None


def check_tensors(
    leaves: Sequence[Any], treespec: TreeSpec, *, name: str, floating: bool = False
) -> None:
    """Raise ``TypeError`` naming the first leaf of ``name`` that is neither a tensor nor None.

    With ``floating``, integer and boolean tensors are rejected too (gradients and updates
    are floating point; an integer update would silently promote or truncate).
    """
    for i, leaf in enumerate(leaves):
        if leaf is None:
            continue
        if not isinstance(leaf, torch.Tensor):
            where = paths(treespec)[i]
            raise TypeError(
                f"{name} leaf {where!r} is {_describe(leaf)}; expected a torch.Tensor or None. "
                f"Fix: convert it with torch.as_tensor(...), or keep non-tensor values out of "
                f"the pytree you hand to functopt."
            )
        if leaf.layout != torch.strided:
            where = paths(treespec)[i]
            raise TypeError(
                f"{name} leaf {where!r} is a {leaf.layout} tensor; functopt transforms take "
                f"dense (strided) tensors, and would treat a sparse one as dense on one path "
                f"and fail on another. Fix: call .to_dense() on it, or use a dense layer "
                f"(nn.Embedding(sparse=False))."
            )
        if floating and not leaf.is_floating_point():
            where = paths(treespec)[i]
            raise TypeError(
                f"{name} leaf {where!r} is {_describe(leaf)}; expected a floating-point tensor. "
                f"Fix: cast it to a floating dtype, or leave integer buffers out of the tree "
                f"you optimize (pass None in their place)."
            )


def check_like(
    leaves: Sequence[Any],
    reference: Sequence[Any],
    treespec: TreeSpec,
    *,
    name: str,
    reference_name: str,
    check_dtype: bool = True,
) -> None:
    """Check each tensor of ``leaves`` against the tensor at the same place in ``reference``.

    Shapes must be equal (no broadcasting), and, with ``check_dtype``, dtypes and devices too.
    ``None`` on either side is skipped; both lists must already have passed
    `check_tensors`. Raises ``ValueError``/``TypeError`` naming the leaf.
    """
    for i, (leaf, ref) in enumerate(zip(leaves, reference, strict=True)):
        if leaf is None or ref is None:
            continue
        if leaf.shape != ref.shape:
            where = paths(treespec)[i]
            raise ValueError(
                f"{where!r}: {name} has shape {tuple(leaf.shape)} but {reference_name} has shape "
                f"{tuple(ref.shape)}. Fix: {name} must have exactly the shape of "
                f"{reference_name}; functopt does not broadcast between them."
            )
        if check_dtype and leaf.dtype != ref.dtype:
            where = paths(treespec)[i]
            raise TypeError(
                f"{where!r}: {_dtype_name(leaf.dtype)} {name} for {_dtype_name(ref.dtype)} "
                f"{reference_name}. functopt never promotes dtypes silently. Fix: cast with "
                f"functopt.tree.cast(...), or use the mixed-precision stages "
                f"(functopt.precision) to keep a float32 master copy of low-precision params."
            )
        if check_dtype and leaf.device != ref.device:
            where = paths(treespec)[i]
            raise ValueError(
                f"{where!r}: {name} is on {leaf.device} but {reference_name} is on {ref.device}. "
                f"Fix: move them to the same device before the update."
            )


def map_leaves(fn: Callable[..., Any], first: Sequence[Any], *rest: Sequence[Any]) -> list[Any]:
    """Apply ``fn`` leaf by leaf; where ``first`` holds None the result is None."""
    return [
        None if xs[0] is None else fn(*xs) for xs in zip(first, *rest, strict=True)
    ]


def broadcast_prefix(prefix: Tree, target: Tree, treespec: TreeSpec) -> list[Any]:
    """One leaf of ``prefix`` per leaf of ``target`` (whose structure is ``treespec``).

    ``prefix`` has ``target``'s structure or a prefix of it: a leaf of ``prefix`` standing
    where ``target`` has a subtree applies to every leaf of that subtree (as masks and
    partition labels do). Raises ``ValueError`` whose message is where the two differ.
    """
    prefix_leaves, prefix_spec = flatten(prefix)
    if prefix_spec == treespec:
        return prefix_leaves
    try:
        subtrees = prefix_spec.flatten_up_to(target)
    except (ValueError, TypeError):
        raise ValueError(_first_difference(prefix, target, "<root>")) from None
    out: list[Any] = []
    for leaf, subtree in zip(prefix_leaves, subtrees, strict=True):
        out.extend([leaf] * structure(subtree).num_leaves)
    return out
