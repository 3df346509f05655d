"""Public tree utilities: maps, casts, constructors and reductions.

Every function here treats ``None`` as a leaf that stays ``None`` (a parameter without a
gradient, or the state of such a parameter), and names leaves by dotted path in its errors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _python_dispatch

from functopt.tree import _core

__all__ = [
    "cast",
    "full_like",
    "global_norm",
    "map",
    "map_with_path",
    "ones_like",
    "sum",
    "vdot",
    "zeros_like",
]


def _flatten_rest(treespec: _core.TreeSpec, rest: tuple[Any, ...]) -> list[list[Any]]:
    return [
        _core.flatten_like(treespec, other, name=f"rest[{i}]", reference="tree")
        for i, other in enumerate(rest)
    ]


def map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """Apply ``fn`` leaf by leaf: ``fn(leaf, *leaves_of_rest)``, where ``tree``'s leaf is not None.

    ``None`` counts as a leaf (functopt's convention): where ``tree`` holds ``None`` the
    result is ``None`` and ``fn`` is not called, so a tree of params with some ``None``
    gradients maps without special cases. The trees in ``rest`` must have ``tree``'s
    structure (a mismatch is reported by path); their leaves may be ``None`` anywhere and are
    passed to ``fn`` as they are.

    Args:
        fn: called as ``fn(x, *ys)`` for each leaf ``x`` of ``tree`` that is not ``None``.
        tree: the tree that sets the structure.
        *rest: more trees with ``tree``'s structure.

    Returns:
        A tree of ``tree``'s structure holding ``fn``'s results.

    Examples:
        >>> import torch, functopt
        >>> functopt.tree.map(lambda x, y: x + y, {"a": torch.ones(1), "b": None},
        ...                   {"a": torch.ones(1), "b": None})
        {'a': tensor([2.]), 'b': None}
    """
    leaves, treespec = _core.flatten(tree)
    others = _flatten_rest(treespec, rest)
    return _core.unflatten(treespec, _core.map_leaves(fn, leaves, *others))


def map_with_path(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """Like [`map`][functopt.tree.map], with the leaf's dotted path first: ``fn(path, leaf, *leaves_of_rest)``.

    Paths are the strings functopt uses in its error messages (``'layers.0.weight'``,
    ``'mu.bias'``; ``'<root>'`` for a tree that is a single leaf). ``fn`` is not called where
    ``tree`` holds ``None``.

    Examples:
        >>> import torch, functopt
        >>> params = {"layer": {"weight": torch.ones(2), "bias": None}}
        >>> functopt.tree.map_with_path(lambda path, x: path, params)
        {'layer': {'weight': 'layer.weight', 'bias': None}}
    """
    leaves, treespec = _core.flatten(tree)
    others = _flatten_rest(treespec, rest)
    new = [
        None if x is None else fn(path, x, *ys)
        for path, x, *ys in zip(_core.paths(treespec), leaves, *others, strict=True)
    ]
    return _core.unflatten(treespec, new)


def _check_dtype(owner: str, dtype: Any, *, floating: bool) -> None:
    if dtype is None:
        return
    if not isinstance(dtype, torch.dtype) or (floating and not dtype.is_floating_point):
        kind = "a floating torch.dtype (e.g. torch.bfloat16)" if floating else "a torch.dtype"
        raise TypeError(f"functopt.tree.{owner}: dtype must be None or {kind}, got {dtype!r}.")


def cast(tree: Any, dtype: torch.dtype | None) -> Any:
    """Cast every floating-point tensor of ``tree`` to ``dtype``; everything else stays as is.

    Integer and boolean tensors (step counters, masks), ``None`` and non-tensor leaves are
    returned unchanged, so a whole optimizer state can be cast without breaking its
    counters. Unlike ``optax.tree.cast`` (which casts every leaf), only floating leaves
    move. ``dtype=None`` returns ``tree`` unchanged. The cast is differentiable.

    Args:
        tree: any pytree.
        dtype: a floating ``torch.dtype``, or ``None`` to do nothing.

    Returns:
        A tree of ``tree``'s structure.

    Examples:
        >>> import torch, functopt
        >>> state = {"count": torch.tensor(3, dtype=torch.int32), "mu": torch.ones(2), "nu": None}
        >>> functopt.tree.cast(state, torch.bfloat16)
        {'count': tensor(3, dtype=torch.int32), 'mu': tensor([1., 1.], dtype=torch.bfloat16), 'nu': None}
    """
    _check_dtype("cast", dtype, floating=True)
    if dtype is None:
        return tree
    leaves, treespec = _core.flatten(tree)
    new = [
        x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
        for x in leaves
    ]
    return _core.unflatten(treespec, new)


def _like(owner: str, tree: Any, make: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    leaves, treespec = _core.flatten(tree)
    _core.check_tensors(leaves, treespec, name=f"functopt.tree.{owner}: tree")
    return _core.unflatten(treespec, _core.map_leaves(make, leaves))


def zeros_like(tree: Any, dtype: torch.dtype | None = None) -> Any:
    """A tree of zeros shaped like ``tree`` (``None`` stays ``None``).

    Args:
        tree: a pytree of tensors (and ``None``).
        dtype: the dtype of every new tensor (default: each leaf's own).

    Examples:
        >>> import torch, functopt
        >>> functopt.tree.zeros_like({"w": torch.ones(2), "b": None})
        {'w': tensor([0., 0.]), 'b': None}
    """
    _check_dtype("zeros_like", dtype, floating=False)
    return _like("zeros_like", tree, lambda x: torch.zeros_like(x, dtype=dtype))


def ones_like(tree: Any, dtype: torch.dtype | None = None) -> Any:
    """A tree of ones shaped like ``tree`` (``None`` stays ``None``).

    Examples:
        >>> import torch, functopt
        >>> functopt.tree.ones_like([torch.zeros(2, dtype=torch.float16)])
        [tensor([1., 1.], dtype=torch.float16)]
    """
    _check_dtype("ones_like", dtype, floating=False)
    return _like("ones_like", tree, lambda x: torch.ones_like(x, dtype=dtype))


def full_like(tree: Any, fill_value: float | int | bool, dtype: torch.dtype | None = None) -> Any:
    """A tree filled with ``fill_value``, shaped like ``tree`` (``None`` stays ``None``).

    Args:
        tree: a pytree of tensors (and ``None``).
        fill_value: a Python number (a tensor would need a host read on some devices).
        dtype: the dtype of every new tensor (default: each leaf's own).

    Examples:
        >>> import torch, functopt
        >>> functopt.tree.full_like({"w": torch.zeros(2)}, 0.5)
        {'w': tensor([0.5000, 0.5000])}
    """
    if not isinstance(fill_value, (int, float, bool)):
        raise TypeError(
            f"functopt.tree.full_like: fill_value must be a Python number, got "
            f"{type(fill_value).__name__}. Fix: for a tensor value use "
            f"functopt.tree.map(lambda x: torch.zeros_like(x) + value, tree)."
        )
    _check_dtype("full_like", dtype, floating=False)
    return _like("full_like", tree, lambda x: torch.full_like(x, fill_value, dtype=dtype))


def _accumulation_dtype(leaves: list[Any]) -> torch.dtype:
    if any(isinstance(x, torch.Tensor) and x.dtype == torch.float64 for x in leaves):
        return torch.float64
    return torch.float32


def _tensor_leaves(owner: str, tree: Any) -> tuple[list[Any], _core.TreeSpec]:
    leaves, treespec = _core.flatten(tree)
    _core.check_tensors(leaves, treespec, name=f"functopt.tree.{owner}: tree")
    return leaves, treespec


def _total(terms: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    if not terms:
        return torch.zeros((), dtype=dtype)
    device = terms[0].device
    return torch.stack([t.to(device) for t in terms]).sum()


def sum(tree: Any) -> torch.Tensor:
    """The sum of every element of every leaf, as a 0-d tensor.

    Each leaf is summed in float32 (float64 if any leaf is float64), so low-precision leaves
    neither overflow nor lose the small terms; optax's ``tree.sum`` keeps the leaves' dtype.
    ``None`` leaves are skipped; an empty tree sums to 0. Nothing is read back to the host.

    Examples:
        >>> import torch, functopt
        >>> functopt.tree.sum({"a": torch.tensor([1.0, 2.0]), "b": torch.tensor(3.0), "c": None})
        tensor(6.)
    """
    leaves, _ = _tensor_leaves("sum", tree)
    tensors = [x for x in leaves if x is not None]
    dtype = _accumulation_dtype(tensors)
    return _total([x.sum(dtype=dtype) for x in tensors], dtype)


def vdot(tree_x: Any, tree_y: Any) -> torch.Tensor:
    r"""The inner product of two trees, $\sum_i \langle x_i, y_i \rangle$, as a 0-d tensor.

    The trees must have the same structure, and paired leaves the same shape (no
    broadcasting); a ``None`` on either side counts as zero. Products are summed in float32
    (float64 if any leaf is float64), whatever the leaves' dtypes.

    Examples:
        >>> import torch, functopt
        >>> functopt.tree.vdot({"a": torch.tensor([1.0, 2.0]), "b": None},
        ...                    {"a": torch.tensor([3.0, -1.0]), "b": torch.ones(3)})
        tensor(1.)
    """
    xs, treespec = _tensor_leaves("vdot", tree_x)
    ys = _core.flatten_like(treespec, tree_y, name="tree_y", reference="tree_x")
    _core.check_tensors(ys, treespec, name="functopt.tree.vdot: tree_y")
    _core.check_like(xs, ys, treespec, name="tree_x", reference_name="tree_y", check_dtype=False)
    pairs = [(x, y) for x, y in zip(xs, ys, strict=True) if x is not None and y is not None]
    dtype = _accumulation_dtype([t for pair in pairs for t in pair])
    terms = [(x.to(dtype) * y.to(dtype)).sum() for x, y in pairs]
    return _total(terms, dtype)


def _sum_of_squares(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``sum(x**2)`` as a 0-d float64 tensor, accumulated in ``dtype``.

    The default ``dtype`` is float32 (float64 for float64 x). This is the one definition of
    a leaf's squared norm in functopt (``global_norm``, the mixed-precision step's
    statistics and their distributed form all use it), so that every path agrees on when a
    norm overflows: like ``torch.nn.utils.clip_grad_norm_`` and Megatron, a float32 leaf
    whose norm exceeds about ``1.8e19`` gives inf.
    """
    if dtype is None:
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    out: torch.Tensor = torch.linalg.vector_norm(x, dtype=dtype).to(torch.float64) ** 2
    return out


def _leaf_stats(x: torch.Tensor) -> torch.Tensor:
    """``[sum of squares, non-finite count, zero count]`` of one tensor, float64, shape (3,)."""
    return torch.stack([
        _sum_of_squares(x),
        torch.sum(~torch.isfinite(x), dtype=torch.float64),
        (x.numel() - torch.count_nonzero(x)).to(torch.float64),
    ])


def _host_branch_ok(x: torch.Tensor) -> bool:
    """Whether a step may read a boolean of ``x`` back and branch on it: ``x`` is on the CPU
    (where the value is already computed, so the read costs no synchronisation), no
    ``torch.func`` transform is active (``vmap`` has no data-dependent control flow) and
    the step is not being recorded (`_recording`)."""
    return x.device.type == "cpu" and torch._C._functorch.maybe_current_level() is None and (
        not _recording())


def _scalar(value: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``value`` (a number or a 0-d tensor) as a 0-d tensor of ``dtype`` on ``device``, as
    ``torch.as_tensor`` makes it; a number by a fill on the device rather than a copy from
    the host (which a CUDA graph cannot record)."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype)
    return torch.full((), value, dtype=dtype, device=device)


def _recording() -> bool:
    """Whether the operations that run are recorded to be replayed without the host: a
    CUDA stream capture (a CUDA graph), or a Python dispatch mode that says it replays (a
    ``replays`` attribute that is true: ``functopt.fast``'s tape). A value read on the host
    would then stay what it was when recorded, or cannot be read at all: a step takes its
    device forms (counters advanced by kernels, a learning rate passed as a tensor,
    selections with ``torch.where``). A dispatch mode that only observes (a flop counter,
    ``CommDebugMode``) changes nothing."""
    if torch._C._len_torch_dispatch_stack() > 0 and any(
            getattr(mode, "replays", False)
            for mode in _python_dispatch._get_current_dispatch_mode_stack()):
        return True
    return torch.cuda.is_initialized() and (  # type: ignore[no-untyped-call]
        torch.cuda.is_current_stream_capturing())


def _safe_norm(x: torch.Tensor) -> torch.Tensor:
    """The L2 norm of ``x`` as a 0-d float64 tensor, finite whenever ``x`` is finite and its
    norm is below float64's largest number. The rescue of an overflowing float32 sum of
    squares: slower than the float32 reduction (a float64 copy on the CPU), so it only runs
    where that sum overflowed (or, without a host read, selected by ``_rescued``)."""
    if x.dtype != torch.float64:
        # Squares of float32 (or narrower) values stay below 1.2e77: no float64 overflow.
        wide: torch.Tensor = torch.linalg.vector_norm(x, dtype=torch.float64)
        return wide
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=x.device)
    # A float64 sum of squares overflows above 1.3e154: scale by the largest magnitude.
    peak = torch.linalg.vector_norm(x, ord=math.inf)
    unit = torch.where((peak > 0) & torch.isfinite(peak), peak, torch.ones_like(peak))
    out: torch.Tensor = unit * torch.linalg.vector_norm(x / unit)
    return out


def _combine_norms(norms: torch.Tensor) -> torch.Tensor:
    """The square root of the sum of squares of a float64 vector of norms, without overflow (scaled by the
    largest); inf or nan when a norm is."""
    peak = norms.max()
    unit = torch.where((peak > 0) & torch.isfinite(peak), peak, torch.ones_like(peak))
    # At least 1 whenever peak > 0 (the largest term is 1); the clamp keeps the gradient of
    # sqrt finite when every norm is zero, a branch torch.where then discards.
    out: torch.Tensor = unit * torch.sqrt(torch.clamp(((norms / unit) ** 2).sum(), min=1.0))
    return torch.where(peak > 0, out, peak)


def _rescued(common: torch.Tensor, ok: torch.Tensor, raw: torch.Tensor,
             rescue: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``common`` (a 0-d float64 norm) where ``ok`` (the float32 sums did not overflow);
    else ``rescue()``'s norm where that is finite (every element was finite, only a float32
    sum of squares overflowed); else ``raw``, the non-finite norm (an element is inf or
    nan), with no gradient (inf minus inf is no derivative).

    On the CPU outside ``torch.func`` the rescue runs only when ``ok`` is false (one
    boolean read, free there); elsewhere it is computed every time and selected with
    ``torch.where``, so that a step never waits for the device and ``vmap`` works.
    ``common`` must have finite gradients where it is not selected (see
    ``_global_norm64``)."""
    if _host_branch_ok(ok):
        if bool(ok):
            return common
        wide = rescue()
        return wide if bool(torch.isfinite(wide)) else raw.detach()
    wide = rescue()
    return torch.where(ok, common, torch.where(torch.isfinite(wide), wide, raw.detach()))


def _global_norm64(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm of ``tensors`` (no None) as a 0-d float64 tensor on the first
    tensor's device: float32 accumulation per leaf (float64 for float64 leaves), and the
    rescue of ``_safe_norm`` where that overflowed although every element is finite."""
    device = tensors[0].device
    dtype = _accumulation_dtype(tensors)
    # `_sum_of_squares`, as norms: bitwise the same sum when nothing overflows.
    norms = torch.stack([torch.linalg.vector_norm(x, dtype=dtype).to(torch.float64).to(device)
                         for x in tensors])
    finite = torch.isfinite(norms)
    # Overflowed norms left out of `common`, so that torch.where's unselected branch has no
    # inf * 0 in its gradient; `raw` keeps them for the non-finite answer.
    common = torch.sqrt((torch.where(finite, norms, 0.0) ** 2).sum())
    raw = torch.sqrt((norms ** 2).sum())
    return _rescued(common, finite.all() & torch.isfinite(common), raw, lambda: _combine_norms(
        torch.stack([_safe_norm(x).to(device) for x in tensors])))


def global_norm(tree: Any) -> torch.Tensor:
    r"""The L2 norm of all leaves together, $\sqrt{\sum_i \lVert x_i \rVert_2^2}$.

    Each leaf is reduced in float32, or in float64 when any leaf is float64, so bfloat16 and
    float16 leaves do not lose precision or overflow in the sum, and the leaves' squares
    are summed in float64. The result is float32 (float64 if any leaf is float64). ``None``
    leaves are skipped; an empty tree has norm 0. The result is a 0-d tensor on the first
    leaf's device.

    The norm of finite leaves is finite whenever it is representable in the result's
    dtype: where a leaf's float32 sum of squares overflows (a norm above about ``1.8e19``,
    such as four elements of ``1e30``) although every element is finite, that leaf is
    measured again in float64 (scaled by its largest element for float64 leaves), where
    ``torch.linalg.vector_norm`` and ``torch.nn.utils.clip_grad_norm_`` return inf. The
    common path keeps the float32 reduction; on the CPU the rescue runs only when the
    float32 sum overflowed (one boolean read, which costs no synchronisation there), on
    an accelerator and under ``torch.func`` it is computed at every call and selected
    with ``torch.where``, so nothing is read back to the host. A leaf holding inf or nan
    makes the norm inf or nan.

    Examples:
        >>> import torch, functopt
        >>> functopt.tree.global_norm({"a": torch.tensor([3.0]), "b": torch.tensor([4.0]), "c": None})
        tensor(5.)
        >>> functopt.tree.global_norm({"a": torch.full((4,), 1e30)})  # float32 sum of squares: inf
        tensor(2.0000e+30)
    """
    leaves, treespec = _core.flatten(tree)
    _core.check_tensors(leaves, treespec, name="tree")
    tensors = [x for x in leaves if x is not None]
    dtype = _accumulation_dtype(tensors)
    if not tensors:
        return torch.zeros((), dtype=dtype)
    return _global_norm64(tensors).to(dtype)
