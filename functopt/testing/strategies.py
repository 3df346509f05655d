"""Hypothesis strategies for pytrees of tensors and for the gradients that hit them.

The strategies reach the values optimizers get wrong: zeros, values near zero and
subnormals, huge magnitudes near the dtype's maximum, tiny ones near its smallest normal,
and (when asked) inf and nan, across float16, bfloat16, float32 and float64 leaves of mixed
shapes, including 0-d and empty tensors; and (when asked, ``layout="any"``) the memory
layouts fast paths get wrong: channels_last, transposed and sliced (strided, offset) leaves,
gradients laid out unlike their params, and ``tied`` params (one tensor at two places of the
tree, as tied embeddings are).

Examples:
    >>> from hypothesis import given, settings
    >>> from functopt.testing import strategies as fst
    >>> @settings(max_examples=5)
    ... @given(fst.params_and_gradients())
    ... def test_shapes(pg):
    ...     params, grads = pg
    ...     assert fst.same_layout(params, grads)
    >>> test_shapes()
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from hypothesis import strategies as st

from functopt.tree import _core

__all__ = [
    "FLOAT_DTYPES",
    "LAYOUTS",
    "Layout",
    "LayoutChoice",
    "ValueKind",
    "dtypes",
    "gradients_like",
    "laid_out",
    "layouts_for",
    "params",
    "params_and_gradients",
    "pytrees",
    "same_layout",
    "shapes",
    "tensors",
    "values",
]

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

ValueKind = Literal["typical", "finite", "any"]
"""``typical``: moderate finite values and zeros; ``finite``: also near-zero, subnormal, tiny
and huge magnitudes; ``any``: also inf, -inf and nan."""


Layout = Literal["contiguous", "channels_last", "transposed", "sliced"]
"""A memory layout of a leaf with the same values: ``contiguous``; ``channels_last`` (4-d
leaves); ``transposed`` (the dimensions' strides reversed, 2-d and more: dense, not
contiguous); ``sliced`` (every other element of a larger buffer along the last dimension,
from storage offset 1: neither contiguous nor dense)."""

LAYOUTS: tuple[Layout, ...] = ("contiguous", "channels_last", "transposed", "sliced")

LayoutChoice = Layout | Literal["any"]
"""A `Layout`, or ``"any"``: drawn per leaf among the layouts its shape has."""


def layouts_for(shape: tuple[int, ...]) -> tuple[Layout, ...]:
    """The layouts of `LAYOUTS` a tensor of ``shape`` can take.

    Examples:
        >>> from functopt.testing.strategies import layouts_for
        >>> layouts_for(())
        ('contiguous', 'sliced')
        >>> layouts_for((2, 3, 4, 5))
        ('contiguous', 'channels_last', 'transposed', 'sliced')
    """
    return tuple(layout for layout in LAYOUTS if not (
        (layout == "channels_last" and len(shape) != 4)
        or (layout == "transposed" and len(shape) < 2)))


def laid_out(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    """A tensor equal to ``t`` (bitwise, the same shape and dtype) in ``layout``.

    Raises:
        ValueError: the layout is not one of `layouts_for` ``t``'s shape.

    Examples:
        >>> import torch
        >>> from functopt.testing.strategies import laid_out
        >>> x = laid_out(torch.arange(6.0).reshape(2, 3), "sliced")
        >>> x.stride(), x.storage_offset(), x.tolist()
        ((7, 2), 1, [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]])
        >>> laid_out(torch.zeros(2, 3), "transposed").stride()
        (1, 2)
    """
    if layout not in layouts_for(tuple(t.shape)):
        raise ValueError(
            f"laid_out: a tensor of shape {tuple(t.shape)} has no {layout!r} layout; its "
            f"layouts are {layouts_for(tuple(t.shape))}.")
    if layout == "contiguous":
        return t.contiguous()
    if layout == "channels_last":
        return t.contiguous(memory_format=torch.channels_last)
    if layout == "transposed":
        order = tuple(reversed(range(t.dim())))
        return t.permute(order).contiguous().permute(order)
    # sliced: the odd elements of a buffer twice as long along the last dimension
    shape = tuple(t.shape) if t.dim() else (1,)
    base = torch.full((*shape[:-1], 2 * shape[-1] + 1), float("nan"), dtype=t.dtype,
                      device=t.device)
    view = base[..., 1::2]
    view = view if t.dim() else view.reshape(())
    view.copy_(t)
    return view


def dtypes(choices: tuple[torch.dtype, ...] = FLOAT_DTYPES) -> st.SearchStrategy[torch.dtype]:
    """One of ``choices``.

    Examples:
        >>> import torch
        >>> from hypothesis import given, settings
        >>> from functopt.testing import strategies as fst
        >>> @settings(max_examples=10)
        ... @given(fst.dtypes((torch.float32, torch.bfloat16)))
        ... def check(dtype):
        ...     assert dtype in (torch.float32, torch.bfloat16)
        >>> check()
    """
    return st.sampled_from(choices)


def shapes(*, max_dims: int = 3, max_side: int = 4, allow_empty: bool = True) -> st.SearchStrategy[tuple[int, ...]]:
    """Tensor shapes, including ``()`` and (with ``allow_empty``) shapes with a 0 side.

    Examples:
        >>> from hypothesis import given, settings
        >>> from functopt.testing import strategies as fst
        >>> @settings(max_examples=10)
        ... @given(fst.shapes(max_dims=2, max_side=3))
        ... def check(shape):
        ...     assert len(shape) <= 2 and all(0 <= n <= 3 for n in shape)
        >>> check()
    """
    side = st.integers(0 if allow_empty else 1, max_side)
    return st.lists(side, min_size=0, max_size=max_dims).map(tuple)


def values(dtype: torch.dtype, kind: ValueKind = "finite") -> st.SearchStrategy[float]:
    """Python floats representable (after rounding) in ``dtype``, of the given ``kind``.

    Examples:
        >>> import torch
        >>> from hypothesis import given, settings
        >>> from functopt.testing import strategies as fst
        >>> @settings(max_examples=10)
        ... @given(fst.values(torch.float16, "finite"))
        ... def check(x):
        ...     assert abs(x) <= 65504.0
        >>> check()
    """
    info = torch.finfo(dtype)
    typical = st.one_of(
        st.just(0.0),
        st.just(-0.0),
        st.floats(-10.0, 10.0, allow_nan=False, allow_infinity=False),
        st.integers(-4, 4).map(float),
    )
    if kind == "typical":
        return typical
    magnitude = st.one_of(
        st.floats(info.smallest_normal * 2 ** -8, info.smallest_normal * 4),  # subnormal / tiny
        st.floats(info.eps / 4, info.eps * 4),  # near zero, relative to one
        st.floats(info.max / 64, info.max),  # huge
        st.floats(1e-3, 1e3),
    )
    signed = st.tuples(st.sampled_from((1.0, -1.0)), magnitude).map(lambda sm: sm[0] * sm[1])
    finite = st.one_of(typical, signed)
    if kind == "finite":
        return finite
    return st.one_of(finite, st.sampled_from((float("inf"), float("-inf"), float("nan"))))


@st.composite
def tensors(
    draw: st.DrawFn,
    dtype: torch.dtype | st.SearchStrategy[torch.dtype] | None = None,
    shape: tuple[int, ...] | st.SearchStrategy[tuple[int, ...]] | None = None,
    kind: ValueKind = "finite",
    layout: LayoutChoice = "contiguous",
) -> torch.Tensor:
    """A tensor of the given (or drawn) dtype and shape, with values of ``kind``, in
    ``layout`` (``"any"``: one of `layouts_for` its shape, drawn).

    Examples:
        >>> import torch
        >>> from hypothesis import given, settings
        >>> from functopt.testing import strategies as fst
        >>> @settings(max_examples=10)
        ... @given(fst.tensors(torch.bfloat16, (2, 3), "any"))
        ... def check(t):
        ...     assert t.dtype == torch.bfloat16 and t.shape == (2, 3)
        >>> check()
    """
    if dtype is None:
        dtype = dtypes()
    if isinstance(dtype, st.SearchStrategy):
        dtype = draw(dtype)
    if shape is None:
        shape = shapes()
    if isinstance(shape, st.SearchStrategy):
        shape = draw(shape)
    numel = 1
    for side in shape:
        numel *= side
    flat = draw(st.lists(values(dtype, kind), min_size=numel, max_size=numel))
    out = torch.tensor(flat, dtype=torch.float64).reshape(shape).to(dtype)
    chosen = draw(st.sampled_from(layouts_for(shape))) if layout == "any" else layout
    return out if chosen == "contiguous" else laid_out(out, chosen)


def _shapes_with_layouts() -> st.SearchStrategy[tuple[int, ...]]:
    """`shapes`, and small 4-d shapes (channels_last needs four dimensions)."""
    side = st.integers(0, 2)
    return st.one_of(shapes(), st.tuples(side, st.integers(1, 3), side, side))


def pytrees(leaves: st.SearchStrategy[Any], *, max_leaves: int = 6) -> st.SearchStrategy[Any]:
    """Nested dicts, lists and tuples whose leaves come from ``leaves``.

    Examples:
        >>> import functopt
        >>> from hypothesis import strategies as st
        >>> from hypothesis import given, settings
        >>> from functopt.testing import strategies as fst
        >>> @settings(max_examples=10)
        ... @given(fst.pytrees(st.integers(), max_leaves=4))
        ... def check(tree):
        ...     assert len(functopt.tree.flatten(tree)[0]) <= 4
        >>> check()
    """
    keys = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=6)
    return st.recursive(
        leaves,
        lambda children: st.one_of(
            st.dictionaries(keys, children, min_size=1, max_size=3),
            st.lists(children, min_size=1, max_size=3),
            st.lists(children, min_size=1, max_size=3).map(tuple),
        ),
        max_leaves=max_leaves,
    )


def params(
    *,
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES,
    kind: ValueKind = "typical",
    max_leaves: int = 6,
    shape: st.SearchStrategy[tuple[int, ...]] | None = None,
    allow_none: bool = False,
    layout: LayoutChoice = "contiguous",
    tied: bool = False,
) -> st.SearchStrategy[Any]:
    """Pytrees of parameter tensors of mixed dtypes and shapes (0-d and empty included).

    With ``layout="any"`` each leaf is drawn in one of the layouts its shape has (and 4-d
    shapes join the default shapes, for channels_last); with ``tied`` some trees hold one
    tensor at two places (the same object, as tied weights are).

    Examples:
        >>> import functopt
        >>> from hypothesis import given, settings
        >>> from functopt.testing import strategies as fst
        >>> @settings(max_examples=10)
        ... @given(fst.params(max_leaves=3))
        ... def check(params):
        ...     leaves = functopt.tree.flatten(params)[0]
        ...     assert all(p.is_floating_point() for p in leaves)
        >>> check()
    """
    if shape is None:
        shape = shapes() if layout == "contiguous" else _shapes_with_layouts()
    leaf: st.SearchStrategy[Any] = tensors(st.sampled_from(dtypes), shape, kind, layout)
    if allow_none:
        leaf = st.one_of(leaf, st.none())
    trees = pytrees(leaf, max_leaves=max_leaves)
    return _with_ties(trees) if tied else trees


@st.composite
def _with_ties(draw: st.DrawFn, trees: st.SearchStrategy[Any]) -> Any:
    """A tree from ``trees``, in which (sometimes) a later tensor leaf is replaced by an
    earlier one: the same object at two places."""
    tree = draw(trees)
    leaves, treespec = _core.flatten(tree)
    at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    if len(at) < 2 or not draw(st.booleans()):
        return tree
    source, target = sorted(draw(st.lists(st.sampled_from(at), min_size=2, max_size=2,
                                          unique=True)))
    leaves[target] = leaves[source]
    return _core.unflatten(treespec, leaves)


@st.composite
def gradients_like(
    draw: st.DrawFn, reference: Any, *, kind: ValueKind = "finite", allow_none: bool = False,
    layout: LayoutChoice = "contiguous",
) -> Any:
    """A tree of gradients with ``reference``'s structure, shapes and dtypes.

    With ``allow_none``, some gradient leaves are ``None`` (params that got no gradient).
    Each gradient is laid out in ``layout``, drawn per leaf for ``"any"`` (independently of
    its param's, so that strides often differ).

    Examples:
        >>> import torch
        >>> from hypothesis import given, settings
        >>> from functopt.testing import strategies as fst
        >>> @settings(max_examples=10)
        ... @given(fst.gradients_like({"w": torch.ones(2, dtype=torch.float16)}, allow_none=True))
        ... def check(grads):
        ...     g = grads["w"]
        ...     assert g is None or (g.dtype == torch.float16 and g.shape == (2,))
        >>> check()
    """
    leaves, treespec = _core.flatten(reference)
    out: list[torch.Tensor | None] = []
    for leaf in leaves:
        if leaf is None or (allow_none and draw(st.booleans())):
            out.append(None)
        else:
            out.append(draw(tensors(leaf.dtype, tuple(leaf.shape), kind, layout)))
    return _core.unflatten(treespec, out)


@st.composite
def params_and_gradients(
    draw: st.DrawFn,
    *,
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES,
    param_kind: ValueKind = "typical",
    grad_kind: ValueKind = "finite",
    max_leaves: int = 6,
    allow_none: bool = False,
    layout: LayoutChoice = "contiguous",
    tied: bool = False,
) -> tuple[Any, Any]:
    """A ``(params, grads)`` pair of the same structure, shapes and dtypes.

    ``layout`` and ``tied`` are those of `params` (``layout`` is drawn for the gradients
    too, independently: a gradient's strides may differ from its param's).

    Examples:
        >>> import functopt
        >>> from hypothesis import given, settings
        >>> from functopt.testing import strategies as fst
        >>> @settings(max_examples=10)
        ... @given(fst.params_and_gradients(grad_kind="any", allow_none=True))
        ... def check(pair):
        ...     params, grads = pair
        ...     assert functopt.tree.structure(params) == functopt.tree.structure(grads)
        >>> check()
    """
    p = draw(params(dtypes=dtypes, kind=param_kind, max_leaves=max_leaves, layout=layout,
                    tied=tied))
    g = draw(gradients_like(p, kind=grad_kind, allow_none=allow_none, layout=layout))
    return p, g


def same_layout(a: Any, b: Any) -> bool:
    """Whether two trees have the same structure and, leaf by leaf, shape, dtype and device
    (``None`` matches ``None`` only).

    Examples:
        >>> import torch
        >>> from functopt.testing.strategies import same_layout
        >>> same_layout({"w": torch.ones(2)}, {"w": torch.zeros(2)})
        True
        >>> same_layout({"w": torch.ones(2)}, {"w": torch.zeros(2, dtype=torch.float16)})
        False
    """
    a_leaves, a_spec = _core.flatten(a)
    b_leaves, b_spec = _core.flatten(b)
    if a_spec != b_spec:
        return False
    for x, y in zip(a_leaves, b_leaves, strict=True):
        if (x is None) != (y is None):
            return False
        if x is not None and (x.shape != y.shape or x.dtype != y.dtype or x.device != y.device):
            return False
    return True
