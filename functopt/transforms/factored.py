"""Adafactor's factored second-moment estimate: ``scale_by_factored_rms``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from functopt import _validate
from functopt._base import GradientTransformation, Numeric, Params, Updates
from functopt._collective.dtensor import is_dtensor
from functopt._rules import state_slots
from functopt._spec import PerLeaf, specified
from functopt.transforms import _common
from functopt.tree import _core

__all__ = ["FactoredState", "scale_by_factored_rms"]


def _decay_rate_pow(step: torch.Tensor, exponent: Numeric = 0.8) -> torch.Tensor:
    r"""Adafactor's schedule $\hat\beta_{2,t} = 1 - t^{-\text{exponent}}$, ``t = step + 1``.

    Computed in float32, as optax does (so 0 on the first step, tending to 1), whether
    ``exponent`` is a number or an (injected, float64) 0-d tensor.
    """
    t = (step + 1).to(torch.float32)
    decay: torch.Tensor = 1.0 - t ** (-_common.scalar(exponent, torch.float32))
    return decay


def _factored_dims(
    shape: Sequence[int], factored: bool, min_dim_size_to_factor: int
) -> tuple[int, int] | None:
    """``(second largest dim, largest dim)``, or None where the leaf is not factored.

    A leaf is factored when it has at least 2 dims and its second largest side is at least
    ``min_dim_size_to_factor``. Ties keep the lower index first (a stable sort), so a square
    matrix gets ``(0, 1)`` as in optax. optax uses numpy's default argsort, which is not
    stable for every shape of 3+ dims (it orders ``(1, 1, 0, 0)`` as ``[3, 2, 1, 0]`` on
    some builds); there the two may lay the state out differently, but the estimate is the
    same, since it is symmetric in two equal sides.
    """
    if not factored or len(shape) < 2:
        return None
    order = sorted(range(len(shape)), key=lambda i: shape[i])
    if shape[order[-2]] < min_dim_size_to_factor:
        return None
    return order[-2], order[-1]


def _state_shapes(
    shape: torch.Size, dims: tuple[int, int] | None
) -> tuple[torch.Size, torch.Size, torch.Size]:
    """Shapes of ``(v_row, v_col, v)`` for a leaf of ``shape`` factored over ``dims``."""
    placeholder = torch.Size((1,))
    if dims is None:
        return placeholder, placeholder, shape
    d1, d0 = dims
    return shape[:d0] + shape[d0 + 1:], shape[:d1] + shape[d1 + 1:], placeholder


class FactoredState(NamedTuple):
    """State of [`scale_by_factored_rms`][functopt.scale_by_factored_rms].

    Each leaf uses either ``v_row`` and ``v_col`` (factored) or ``v`` (not factored); the
    unused fields hold a placeholder ``zeros((1,))`` of the param's dtype, as in optax.
    For a factored leaf with dims ``(d1, d0) = (second largest, largest)``:
    """

    # The name shadows tuple.count (hence the ignore); kept: optax's name, public API.
    count: torch.Tensor  # type: ignore[assignment]  # int32, shape (): updates done so far
    v_row: Updates  # like params, param's dtype; param shape without d0: mean over d0 of the EMA
    v_col: Updates  # like params, param's dtype; param shape without d1: mean over d1 of the EMA
    v: Updates  # like params, param's dtype and shape (unfactored leaves): EMA of g**2 + epsilon


def _leaf(g: torch.Tensor, row: torch.Tensor, col: torch.Tensor, full: torch.Tensor,
          dims: tuple[int, int] | None, decay: Any, epsilon: Numeric,
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One leaf's ``(update, v_row, v_col, v)`` (see ``scale_by_factored_rms``)."""
    wide = g.to(_common.compute_dtype(g.dtype, row.dtype, col.dtype, full.dtype))
    beta, rest = _common.scalar(decay, wide.dtype), _common.scalar(1 - decay, wide.dtype)
    grad_sqr = wide * wide + _common.scalar(epsilon, wide.dtype)
    if dims is None:
        full_t = beta * full.to(wide.dtype) + rest * grad_sqr
        return (wide * torch.rsqrt(full_t)).to(g.dtype), row, col, full_t.to(full.dtype)
    d1, d0 = dims
    row_t = beta * row.to(wide.dtype) + rest * grad_sqr.mean(dim=d0)
    col_t = beta * col.to(wide.dtype) + rest * grad_sqr.mean(dim=d1)
    # In row_t (d0 removed) the d1 axis moves down by one if it came after d0.
    d1_in_row = d1 - 1 if d1 > d0 else d1
    row_factor = torch.rsqrt(row_t / row_t.mean(dim=d1_in_row, keepdim=True))
    col_factor = torch.rsqrt(col_t)
    u = wide * row_factor.unsqueeze(d0) * col_factor.unsqueeze(d1)
    return u.to(g.dtype), row_t.to(row.dtype), col_t.to(col.dtype), full


def _dense(x: torch.Tensor) -> bool:
    """Whether ``x`` covers its memory without gaps or overlaps (some order of its dims is
    contiguous: row-major, transposed, channels_last, ...)."""
    expected = 1
    for d in sorted(range(x.dim()), key=lambda d: x.stride(d)):
        if x.shape[d] != 1 and x.stride(d) != expected:
            return False
        expected *= x.shape[d]
    return True


def _batch_key(g: torch.Tensor, row: torch.Tensor, col: torch.Tensor, full: torch.Tensor,
               dims: tuple[int, int] | None) -> tuple[Any, ...] | None:
    """The batch a leaf joins on the grouped path, or None (run alone): unfactored leaves
    batch by device and dtypes, factored ones also by shape and layout. DTensor shards and
    factored leaves that are empty or not dense run alone, as on the pure path."""
    if any(is_dtensor(x) for x in (g, row, col, full)):
        return None
    dtypes = (g.dtype, row.dtype, col.dtype, full.dtype)
    if dims is None:
        return (None, g.device, dtypes)
    if g.numel() == 0 or not _dense(g):
        return None
    return (dims, g.device, dtypes, tuple(g.shape), g.stride())


# The most elements a stacked batch of factored leaves holds, by device type. On the CPU a
# batch that does not fit in cache runs slower than leaf by leaf (each of its dozen passes
# goes to memory, and a fresh large buffer costs page faults; measured 2x slower for fifty
# 256 x 256 matrices in one batch, docs/performance.md), so batches stay near the cache's
# size. On an accelerator each pass costs its memory traffic either way and the batch
# saves kernel launches, so batches are larger there.
_BATCH_ELEMENTS = {"cpu": 1 << 18}
_BATCH_ELEMENTS_ELSEWHERE = 1 << 24


def _chunked(batches: dict[Any, list[int]], grads: list[Any]) -> list[tuple[Any, list[int]]]:
    """The batches split so that each stacked (factored) one holds at most
    ``_BATCH_ELEMENTS`` elements; an unfactored batch is one foreach call, as it is."""
    out: list[tuple[Any, list[int]]] = []
    for key, idx in batches.items():
        if key[0] is None:
            out.append((key, idx))
            continue
        g = grads[idx[0]]
        cap = _BATCH_ELEMENTS.get(g.device.type, _BATCH_ELEMENTS_ELSEWHERE)
        size = max(1, cap // max(g.numel(), 1))
        out.extend((key, idx[k:k + size]) for k in range(0, len(idx), size))
    return out


def _unfactored_foreach(
    gs: list[torch.Tensor], rows: list[torch.Tensor], cols: list[torch.Tensor],
    fulls: list[torch.Tensor], dims: None, decay: Any, epsilon: Numeric,
) -> tuple[list[Any], ...]:
    """``_leaf`` on unfactored leaves of one device and dtypes, with foreach ops."""
    del dims
    dtype = _common.compute_dtype(gs[0].dtype, rows[0].dtype, cols[0].dtype, fulls[0].dtype)
    # (a foreach op takes its 0-d tensor scalar on the lists' device)
    beta, rest, eps = (x.to(gs[0].device) if isinstance(x, torch.Tensor) else x
                       for x in (_common.scalar(decay, dtype), _common.scalar(1 - decay, dtype),
                                 _common.scalar(epsilon, dtype)))
    wide = [g.to(dtype) for g in gs]
    grad_sqr = torch._foreach_mul(wide, wide)
    torch._foreach_add_(grad_sqr, eps)
    full_t = torch._foreach_mul([f.to(dtype) for f in fulls], beta)
    torch._foreach_add_(full_t, torch._foreach_mul(grad_sqr, rest))
    u = torch._foreach_mul(wide, torch._foreach_rsqrt(full_t))
    return ([x.to(g.dtype) for x, g in zip(u, gs, strict=True)], rows, cols,
            [x.to(f.dtype) for x, f in zip(full_t, fulls, strict=True)])


def _factored_batch(
    gs: list[torch.Tensor], rows: list[torch.Tensor], cols: list[torch.Tensor],
    fulls: list[torch.Tensor], dims: tuple[int, int], decay: Any, epsilon: Numeric,
) -> tuple[list[Any], ...]:
    """``_leaf`` on factored leaves of one shape, layout and dtypes, stacked: the batch
    keeps the leaves' layout (so each reduction runs in the leaf's order) and the batch
    dim is the outermost."""
    g0 = gs[0]
    dtype = _common.compute_dtype(g0.dtype, rows[0].dtype, cols[0].dtype, fulls[0].dtype)
    wide = torch.empty_strided((len(gs), *g0.shape), (g0.numel(), *g0.stride()), dtype=dtype,
                               device=g0.device)
    torch._foreach_copy_(list(wide.unbind(0)), gs)
    beta, rest = _common.scalar(decay, dtype), _common.scalar(1 - decay, dtype)
    grad_sqr = (wide * wide).add_(_common.scalar(epsilon, dtype))  # (in place: a buffer less)
    d1, d0 = dims[0] + 1, dims[1] + 1  # past the batch dim
    row_t = beta * torch.stack(rows).to(dtype) + rest * grad_sqr.mean(dim=d0).contiguous()
    col_t = beta * torch.stack(cols).to(dtype) + rest * grad_sqr.mean(dim=d1).contiguous()
    d1_in_row = d1 - 1 if d1 > d0 else d1
    row_factor = torch.rsqrt(row_t / row_t.mean(dim=d1_in_row, keepdim=True))
    u = wide.mul_(row_factor.unsqueeze(d0)).mul_(torch.rsqrt(col_t).unsqueeze(d1))
    return (list(u.to(g0.dtype).unbind(0)), list(row_t.to(rows[0].dtype).unbind(0)),
            list(col_t.to(cols[0].dtype).unbind(0)), fulls)


def _check_arguments(factored: Any, decay_rate: Any, step_offset: Any,
                     min_dim_size_to_factor: Any, epsilon: Any, decay_rate_fn: Any) -> None:
    """The arguments of ``scale_by_factored_rms``, checked."""
    owner = "scale_by_factored_rms"
    _validate.check_flags(owner, factored=factored)
    _validate.check_range(owner, "decay_rate", decay_rate, low=0.0)
    if isinstance(step_offset, bool) or not isinstance(step_offset, (int, torch.Tensor)):
        raise TypeError(f"{owner}: step_offset must be an int, got "
                        f"{type(step_offset).__name__} {step_offset!r}.")
    if (isinstance(min_dim_size_to_factor, bool) or not isinstance(min_dim_size_to_factor, int)
            or min_dim_size_to_factor < 0):
        raise ValueError(
            f"{owner}: min_dim_size_to_factor must be an int >= 0, got "
            f"{min_dim_size_to_factor!r}. Fix: it is a side length (optax's default is 128)."
        )
    _validate.check_range(owner, "epsilon", epsilon, low=0.0)
    if not callable(decay_rate_fn):
        raise TypeError(f"{owner}: decay_rate_fn must be callable (step, decay_rate) -> decay, "
                        f"got {type(decay_rate_fn).__name__}.")


def _check_state_shapes(treespec: _core.TreeSpec, i: int, g: torch.Tensor,
                        state: tuple[torch.Tensor, ...], expected: tuple[torch.Size, ...]) -> None:
    """Leaf ``i``'s ``(v_row, v_col, v)`` have the shapes its gradient needs."""
    if tuple(x.shape for x in state) != expected:
        raise ValueError(
            f"scale_by_factored_rms: {_core.paths(treespec)[i]!r}: the state (v_row, v_col, v) "
            f"has shapes {', '.join(str(tuple(x.shape)) for x in state)}, but a gradient of "
            f"shape {tuple(g.shape)} needs {', '.join(map(str, expected))}. Fix: build the "
            f"state with init(params) on the params these gradients belong to."
        )


def _run_batch(dims: tuple[int, int] | None, gs: list[Any], rows: list[Any], cols: list[Any],
               fulls: list[Any], decay: Any, epsilon: Numeric) -> Sequence[Sequence[Any]]:
    """``(updates, v_row, v_col, v)`` of one batch of leaves: unfactored ones with foreach
    ops, factored ones stacked (a lone one as it is)."""
    if dims is None:
        return _unfactored_foreach(gs, rows, cols, fulls, None, decay, epsilon)
    if len(gs) == 1:
        return [[x] for x in _leaf(gs[0], rows[0], cols[0], fulls[0], dims, decay, epsilon)]
    return _factored_batch(gs, rows, cols, fulls, dims, decay, epsilon)


def _set_leaves(new: list[list[Any]], idx: list[int], outs: Sequence[Sequence[Any]]) -> None:
    """Write the leaves ``idx`` of each of ``new`` from the matching list of ``outs``."""
    for target, out in zip(new, outs, strict=True):
        for j, i in enumerate(idx):
            target[i] = out[j]


def scale_by_factored_rms(
    factored: bool = True,
    decay_rate: Numeric = 0.8,
    step_offset: int = 0,
    min_dim_size_to_factor: int = 128,
    epsilon: Numeric = 1e-30,
    decay_rate_fn: Callable[[torch.Tensor, Any], Any] = _decay_rate_pow,
) -> GradientTransformation:
    r"""Rescale by Adafactor's factored estimate of the gradient's RMS (Shazeer & Stern).

    With $\beta_t =$ ``decay_rate_fn(count - step_offset, decay_rate)`` (``count``
    the number of updates before this one; by default $1 - (\text{count} -
    \text{step\_offset} + 1)^{-\text{decay\_rate}}$, so 0 on the first step) and
    $G = g^2 + \text{epsilon}$:

    - a leaf with at least two dims whose second largest side is ``>=
      min_dim_size_to_factor`` (and ``factored=True``) keeps two reduced statistics. With
      ``d0`` its largest dim and ``d1`` the second largest (ties: lower index first),

      $$
      R_t = \beta_t R_{t-1} + (1-\beta_t)\,\text{mean}_{d_0}(G), \quad
      C_t = \beta_t C_{t-1} + (1-\beta_t)\,\text{mean}_{d_1}(G), \\
      \hat V_t = R_t\, C_t / \text{mean}_{d_1}(R_t), \quad u = g / \sqrt{\hat V_t},
      $$

      (``R`` is ``v_row``, ``C`` is ``v_col``; the rank-1 estimate is broadcast along the
      remaining dims, which are treated as a batch);
    - any other leaf keeps the full EMA $V_t = \beta_t V_{t-1} + (1-\beta_t) G$ and
      gets $u = g / \sqrt{V_t}$.

    State leaves have the param's dtype (as optax); the maths runs in at least float32, so
    ``epsilon = 1e-30`` survives for float16 params and a zero float16 gradient gives a
    zero update rather than optax's ``0 * inf = NaN``. ``None`` gradients leave their
    statistics unchanged. Which leaves are factored depends on the param's shape only.

    Args:
        factored: use the factored estimate where a leaf qualifies.
        decay_rate: the second argument of ``decay_rate_fn`` (the default schedule's
            exponent), >= 0.
        step_offset: subtracted from the count before ``decay_rate_fn`` sees it (set it to
            the first step of a fine-tuning run to restart the schedule).
        min_dim_size_to_factor: the second largest side a leaf needs to be factored, >= 0.
        epsilon: added to the squared gradient, >= 0.
        decay_rate_fn: ``(step, decay_rate) -> decay``, where ``step`` is a 0-d int32
            tensor; it returns a number or a 0-d tensor in [0, 1].

    Returns:
        A [`GradientTransformation`][functopt.GradientTransformation] with [`FactoredState`][functopt.FactoredState]. Unlike
        optax, ``update`` does not require ``params`` (a gradient has its param's shape,
        which is all the layout depends on); when given they are checked against it.

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.scale_by_factored_rms(min_dim_size_to_factor=2, epsilon=0.0)
        >>> params = {"w": torch.zeros(2, 3)}
        >>> state = tx.init(params)
        >>> tuple(state.v_row["w"].shape), tuple(state.v_col["w"].shape)
        ((2,), (3,))
        >>> u, state = tx.update({"w": torch.ones(2, 3)}, state, params)
        >>> u["w"]
        tensor([[1., 1., 1.],
                [1., 1., 1.]])

    References:
        Shazeer & Stern, *Adafactor: Adaptive Learning Rates with Sublinear Memory Cost*,
        ICML 2018.
        Zhai et al., *Scaling Vision Transformers*, 2021 (capped decay schedules).
    """
    owner = "scale_by_factored_rms"
    _check_arguments(factored, decay_rate, step_offset, min_dim_size_to_factor, epsilon,
                     decay_rate_fn)

    def init_fn(params: Params) -> FactoredState:
        leaves, treespec = _common.flatten_params(params)
        zeros = [(None, None, None) if p is None else tuple(map(p.new_zeros, _state_shapes(
            p.shape, _factored_dims(p.shape, factored, min_dim_size_to_factor)))) for p in leaves]
        v_row, v_col, v = (_common.unflatten(treespec, [z[k] for z in zeros]) for k in range(3))
        return FactoredState(count=_common.zero_count(leaves), v_row=v_row, v_col=v_col, v=v)

    def step(updates: Updates, state: FactoredState, params: Params | None,
             grouped: bool) -> tuple[Updates, FactoredState]:
        _common.check_state("scale_by_factored_rms", state, FactoredState)
        grads, treespec = _common.flatten_updates(updates)
        if params is not None:  # only checked: a gradient has its param's shape
            _common.params_like(treespec, params, grads, owner=owner)
        rows = _common.state_like(treespec, state.v_row, name="state.v_row", like=grads)
        cols = _common.state_like(treespec, state.v_col, name="state.v_col", like=grads)
        fulls = _common.state_like(treespec, state.v, name="state.v", like=grads)
        _common.check_state_present(owner, treespec, grads, same_shape=False, v_row=rows, v_col=cols,
                             v=fulls)
        decay = decay_rate_fn(state.count - step_offset, decay_rate)

        new = [list(grads), list(rows), list(cols), list(fulls)]  # updates and state fields
        batches: dict[Any, list[int]] = {}
        for i, (g, row, col, full) in enumerate(zip(grads, rows, cols, fulls, strict=True)):
            if g is None:
                continue
            dims = _factored_dims(g.shape, factored, min_dim_size_to_factor)
            _check_state_shapes(treespec, i, g, (row, col, full), _state_shapes(g.shape, dims))
            key = _batch_key(g, row, col, full, dims) if grouped else None
            if key is None:
                _set_leaves(new, [i], [[x] for x in _leaf(g, row, col, full, dims, decay,
                                                           epsilon)])
            else:
                batches.setdefault(key, []).append(i)
        for key, idx in _chunked(batches, grads):
            # the planner's per-leaf tier: the unfactored leaves of a device and dtype with
            # foreach ops, the factored ones of a shape and layout as one stacked batch
            # (the same elementwise operations and reductions as leaf by leaf)
            _set_leaves(new, idx, _run_batch(
                key[0], [grads[i] for i in idx], [rows[i] for i in idx],
                [cols[i] for i in idx], [fulls[i] for i in idx], decay, epsilon))
        new_updates, new_rows, new_cols, new_fulls = (_common.unflatten(treespec, x) for x in new)
        return new_updates, FactoredState(count=_common.safe_increment(state.count),
                                          v_row=new_rows, v_col=new_cols, v=new_fulls)

    def update_fn(
        updates: Updates, state: FactoredState, params: Params | None = None,
        **extra_args: Any,
    ) -> tuple[Updates, FactoredState]:
        del extra_args
        return step(updates, state, params, grouped=False)

    def grouped_fn(
        updates: Updates, state: FactoredState, params: Params | None = None,
        **extra_args: Any,
    ) -> tuple[Updates, FactoredState]:
        del extra_args
        return step(updates, state, params, grouped=True)

    # factored moments reduce within a leaf: the planner's per-leaf tier runs them a group
    # at a time (functopt/fast/_perleaf.py)
    return specified(GradientTransformation(init_fn, update_fn), PerLeaf(
        "scale_by_factored_rms", {
            "factored": factored, "decay_rate": decay_rate, "step_offset": step_offset,
            "min_dim_size_to_factor": min_dim_size_to_factor, "epsilon": epsilon,
            "decay_rate_fn": decay_rate_fn},
        slots=state_slots(FactoredState), grouped=grouped_fn))
