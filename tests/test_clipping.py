"""clip, clip_by_block_rms, clip_by_global_norm, adaptive_grad_clip: against float64
references written here, torch.nn.utils.clip_grad_norm_, and their non-finite rules."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functopt
from functopt.testing import assert_bitwise_equal, clone_tree
from functopt.testing import strategies as fst

F32_MAX = torch.finfo(torch.float32).max
RTOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5, torch.float64: 1e-12}


def _leaves(tree: Any) -> list[Any]:
    return functopt.tree.flatten(tree)[0]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _update(tx, grads, params=None):
    """One update, checking purity (inputs bitwise unchanged) and the output layout."""
    state = tx.init(params if params is not None else grads)
    before = (clone_tree(grads), clone_tree(params))
    out, new_state = tx.update(grads, state, params, unused_extra_arg=1.0)
    assert_bitwise_equal(grads, before[0], what="input")
    assert_bitwise_equal(params, before[1], what="input")
    assert fst.same_layout(out, grads)
    assert new_state == functopt.EmptyState()
    return out


def _assert_matches(out: torch.Tensor, expected64: torch.Tensor) -> None:
    dtype = out.dtype
    torch.testing.assert_close(
        out.double(), expected64.to(dtype).double(), rtol=RTOL[dtype],
        atol=torch.finfo(dtype).smallest_normal, equal_nan=True,
    )


def _accumulates_in_float32(t: torch.Tensor) -> bool:
    return t.dtype != torch.float64


# --------------------------------------------------------------------------------------- clip


@given(fst.params_and_gradients(grad_kind="any", allow_none=True), st.floats(0.0, 10.0))
def test_clip_is_an_elementwise_clamp(pg, max_delta) -> None:
    _, grads = pg
    out = _update(functopt.clip(max_delta), grads)
    for g, o in zip(_leaves(grads), _leaves(out), strict=True):
        if g is None:
            assert o is None
            continue
        expected = g.double().clamp(-max_delta, max_delta).to(g.dtype)
        assert torch.equal(o.isnan(), expected.isnan())
        assert torch.equal(torch.nan_to_num(o), torch.nan_to_num(expected))


def test_clip_tensor_bound_is_differentiable() -> None:
    bound = torch.tensor(1.0, requires_grad=True)
    tx = functopt.clip(bound)
    out = tx.update({"w": torch.tensor([3.0, -5.0, 0.5, 2.0])}, tx.init(None))[0]["w"]
    (d_bound,) = torch.autograd.grad(out.sum(), bound)
    assert out.tolist() == [1.0, -1.0, 0.5, 1.0]
    assert d_bound.item() == 1.0  # +1 twice from the top, -1 once from the bottom


# ---------------------------------------------------------------------------- clip_by_block_rms


def _block_rms_reference(g: torch.Tensor, threshold: float) -> torch.Tensor:
    g64 = g.double()
    sum_sq = (g64 * g64).sum()
    # As in _agc_reference: a one-element norm is |x|, so only more elements overflow.
    if _accumulates_in_float32(g) and sum_sq > F32_MAX and g.numel() > 1:
        return torch.full_like(g64, math.nan)
    rms = torch.sqrt(sum_sq / max(g.numel(), 1))
    if not torch.isfinite(rms):
        return torch.full_like(g64, math.nan)
    return g64 / max(1.0, (rms / threshold).item())


@given(fst.params_and_gradients(grad_kind="any", allow_none=True), st.floats(0.01, 10.0))
def test_clip_by_block_rms_matches_reference(pg, threshold) -> None:
    _, grads = pg
    out = _update(functopt.clip_by_block_rms(threshold), grads)
    for g, o in zip(_leaves(grads), _leaves(out), strict=True):
        if g is not None:
            _assert_matches(o, _block_rms_reference(g, threshold))


def test_clip_by_block_rms_bounds_each_leaf_separately() -> None:
    tx = functopt.clip_by_block_rms(1.0)
    u = {"big": torch.full((4,), 10.0), "small": torch.full((3,), 0.5)}
    out = tx.update(u, tx.init(None))[0]
    torch.testing.assert_close(out["big"], torch.ones(4))
    assert out["small"] is not u["small"] and torch.equal(out["small"], u["small"])


# -------------------------------------------------------------------------- clip_by_global_norm


def _norm_reference(leaves: list[torch.Tensor]) -> float:
    """The exact global norm in Python floats, scaled by the largest element (no overflow)."""
    values = [abs(v) for x in leaves for v in x.double().reshape(-1).tolist()]
    peak = max(values, default=0.0)
    if peak == 0.0:
        return 0.0
    return peak * math.sqrt(sum((v / peak) ** 2 for v in values))


@given(fst.params_and_gradients(grad_kind="any", allow_none=True), st.floats(0.01, 10.0))
def test_clip_by_global_norm_matches_reference(pg, max_norm) -> None:
    _, grads = pg
    out = _update(functopt.clip_by_global_norm(max_norm), grads)
    pairs = [(g, o) for g, o in zip(_leaves(grads), _leaves(out), strict=True) if g is not None]
    if not torch.isfinite(functopt.tree.global_norm(grads)):
        # The documented rule: no meaningful scale exists, every update becomes nan.
        assert all(o.isnan().all() for _, o in pairs)
        return
    norm64 = _norm_reference([g for g, _ in pairs])
    factor = 1.0 if norm64 < max_norm else max_norm / norm64
    for g, o in pairs:
        _assert_matches(o, g.double() * factor)
    out_norm = math.sqrt(sum((o.double() ** 2).sum().item() for _, o in pairs))
    assert out_norm <= max_norm * (1 + 2e-2) or math.isclose(out_norm, norm64, rel_tol=2e-2)


def test_clip_by_global_norm_matches_torch_clip_grad_norm() -> None:
    gen = torch.Generator().manual_seed(0)
    grads = {"w": torch.randn(5, 3, generator=gen, dtype=torch.float64),
             "b": torch.randn(5, generator=gen, dtype=torch.float64)}
    for max_norm in (0.5, 2.0, 100.0):
        tx = functopt.clip_by_global_norm(max_norm)
        ours = tx.update(grads, tx.init(grads))[0]
        params = [torch.zeros_like(g, requires_grad=True) for g in grads.values()]
        for p, g in zip(params, grads.values(), strict=True):
            p.grad = g.clone()
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        for p, key in zip(params, grads, strict=True):
            # torch divides by norm + 1e-6, hence the tolerance.
            torch.testing.assert_close(ours[key], p.grad, rtol=1e-5, atol=0)


def test_clip_by_global_norm_leaves_small_updates_unchanged_bitwise() -> None:
    tx = functopt.clip_by_global_norm(10.0)
    u = {"a": torch.tensor([3.0, -4.0], dtype=torch.bfloat16), "b": None}
    out = tx.update(u, tx.init(None))[0]
    assert out["b"] is None
    assert torch.equal(_bits(out["a"]), _bits(u["a"]))


@pytest.mark.parametrize(
    ("values", "dtype"),
    [
        ([1.0, math.nan], torch.float32),
        ([1.0, math.inf], torch.float32),
        ([-math.inf, 2.0], torch.bfloat16),
        ([1e20, math.inf], torch.float32),  # an inf beside an overflowing sum: still nan
    ],
    ids=["nan", "inf", "-inf-bf16", "inf-and-overflow"],
)
def test_clip_by_global_norm_non_finite_norm_gives_nan_everywhere(values, dtype) -> None:
    tx = functopt.clip_by_global_norm(1.0)
    u = {"bad": torch.tensor(values, dtype=dtype), "fine": torch.tensor([0.25, -0.5]), "none": None}
    out = tx.update(u, tx.init(None))[0]
    assert out["none"] is None
    assert out["bad"].isnan().all() and out["fine"].isnan().all()  # never silently zero


@pytest.mark.parametrize(
    ("values", "dtype"),
    [
        ([1e20, 1e20], torch.float32),  # the float32 sum of squares overflows: 2e40
        ([1e30] * 4, torch.float32),  # the case (torch: zeros, optax: nan)
        ([3e38, -3e38, 3e38], torch.float32),  # a norm beyond float32's range
        ([6e4, 6e4, 6e4], torch.float16),  # accumulated in float32: no overflow at all
        ([1e200, -1e200], torch.float64),  # the float64 sum of squares overflows
    ],
    ids=["f32-1e20", "f32-1e30", "f32-beyond-range", "f16", "f64-1e200"],
)
def test_clip_by_global_norm_of_finite_huge_updates_is_finite(values, dtype) -> None:
    u = {"big": torch.tensor(values, dtype=dtype), "fine": torch.tensor([0.25, -0.5]),
         "none": None}
    out = _update(functopt.clip_by_global_norm(1.0), u)
    norm64 = _norm_reference([u["big"], u["fine"]])
    assert math.isfinite(norm64)
    for key in ("big", "fine"):
        expected = torch.tensor([v / norm64 for v in u[key].double().tolist()],
                                dtype=torch.float64)
        _assert_matches(out[key], expected)
    norm = functopt.tree.global_norm({k: v for k, v in u.items() if v is not None})
    if norm64 <= torch.finfo(norm.dtype).max:
        assert math.isclose(norm.item(), norm64, rel_tol=1e-6)
    else:
        assert norm.item() == math.inf  # the right answer is not a float32 number


def _squares_stay_normal(v: float) -> bool:
    # float32 accumulation (as clip_grad_norm_ and Megatron) squares each value: below
    # about 1.1e-19 the square is subnormal or 0 in float32, and the norm of a leaf of
    # only such values loses its relative precision (see the test below); the rescue is for
    # overflow, which would make a finite step nan.
    return v == 0 or abs(v) >= 1.1e-19


@settings(max_examples=40)
@given(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False).filter(
           _squares_stay_normal), min_size=1, max_size=6),
       st.lists(st.floats(-1e3, 1e3, width=32).filter(_squares_stay_normal), min_size=1,
                max_size=4))
def test_global_norm_of_finite_float32_leaves_is_exact(big, small) -> None:
    leaves = [torch.tensor(big), torch.tensor(small)]
    norm = functopt.tree.global_norm(leaves).item()
    norm64 = _norm_reference(leaves)
    if norm64 > F32_MAX * (1 - 1e-7):
        return  # rounds to inf or to the largest float32: both right
    assert math.isclose(norm, norm64, rel_tol=2e-7, abs_tol=1e-45)


def test_global_norm_of_tiny_float32_leaves_underflows_as_torch_does() -> None:
    """Values whose squares underflow float32 (|x| < 1.1e-19): the norm is the float32
    reduction's, as torch.linalg.vector_norm (and so clip_grad_norm_) computes it; no
    rescue (it would cost a float64 pass over every all-zero leaf)."""
    leaves = [torch.tensor([0.0]), torch.tensor([0.0, 1.1754943508222875e-38])]
    want = torch.linalg.vector_norm(torch.cat(leaves), dtype=torch.float32)
    assert torch.equal(functopt.tree.global_norm(leaves), want)


def test_global_norm_common_path_is_bitwise_the_float32_reduction() -> None:
    gen = torch.Generator().manual_seed(3)
    leaves = [torch.randn(7, 5, generator=gen), torch.randn(3, generator=gen).bfloat16()]
    squares = [torch.linalg.vector_norm(x, dtype=torch.float32).double() ** 2 for x in leaves]
    want = torch.sqrt(torch.stack(squares).sum()).float()
    assert torch.equal(functopt.tree.global_norm(leaves), want)


def test_global_norm_rescue_under_torch_func_matches_eager() -> None:
    # Under torch.func the rescue is computed and selected with torch.where (no host read).
    xs = torch.tensor([[1e30, 1e30, 1e30], [1.0, 2.0, 2.0], [1e20, math.inf, 0.0]])
    batched = torch.func.vmap(lambda x: functopt.tree.global_norm({"x": x}))(xs)
    eager = torch.stack([functopt.tree.global_norm({"x": x}) for x in xs])
    assert torch.equal(batched, eager)
    assert math.isclose(eager[0].item(), math.sqrt(3) * 1e30, rel_tol=1e-6)
    assert eager[1].item() == 3.0 and eager[2].item() == math.inf

    def clipped_sum(g: torch.Tensor) -> torch.Tensor:
        tx = functopt.clip_by_global_norm(1.0)
        return tx.update({"g": g}, tx.init(None))[0]["g"].sum()

    for g in (torch.tensor([1e20, 1e20]), torch.tensor([3.0, 4.0]), torch.tensor([1e30, -2.0])):
        d_func = torch.func.grad(clipped_sum)(g)
        leaf = g.clone().requires_grad_(True)
        (d_eager,) = torch.autograd.grad(clipped_sum(leaf), leaf)
        assert torch.isfinite(d_func).all(), g
        torch.testing.assert_close(d_func, d_eager, rtol=1e-6, atol=0.0)


def test_clip_by_global_norm_gradient_through_max_norm_is_finite() -> None:
    max_norm = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
    tx = functopt.clip_by_global_norm(max_norm)
    zeros = {"w": torch.zeros(3, dtype=torch.float64)}
    (d_zero,) = torch.autograd.grad(tx.update(zeros, tx.init(None))[0]["w"].sum(), max_norm)
    assert d_zero.item() == 0.0  # not nan: the unused branch divides by max(norm, max_norm)
    g = {"w": torch.tensor([3.0, 4.0, 0.0], dtype=torch.float64)}
    (d_clip,) = torch.autograd.grad(tx.update(g, tx.init(None))[0]["w"].sum(), max_norm)
    torch.testing.assert_close(d_clip, torch.tensor(7.0 / 5.0, dtype=torch.float64))


# --------------------------------------------------------------------------- adaptive_grad_clip


def _units(x: torch.Tensor) -> list[Any]:
    """Index expressions of the units of ``x`` in PyTorch's layout."""
    if sum(1 for side in x.shape if side != 1) <= 1:
        return [...]
    return list(range(x.shape[0]))


def _agc_reference(g: torch.Tensor, p: torch.Tensor, clipping: float, eps: float) -> torch.Tensor:
    g64, p64 = g.double(), p.double()
    out = g64.clone()
    for unit in _units(g):
        sum_sq = (g64[unit] ** 2).sum()
        g_norm = sum_sq.sqrt().item()
        max_norm = clipping * max((p64[unit] ** 2).sum().sqrt().item(), eps)
        # torch.linalg.vector_norm returns |x| for a one-element tensor (no squaring), so a
        # single huge element does not overflow the float32 accumulator; more elements do.
        overflow = (_accumulates_in_float32(g) and sum_sq > F32_MAX
                    and g64[unit].numel() > 1)
        if overflow or not math.isfinite(g_norm):
            out[unit] = math.nan
        elif not g_norm < max_norm:
            out[unit] = g64[unit] * (max_norm / max(g_norm, 1e-6))
    return out


@settings(max_examples=20)
@given(
    fst.params_and_gradients(grad_kind="any", allow_none=True),
    st.floats(0.0, 2.0),
    st.sampled_from([1e-3, 0.0, 0.5]),
)
def test_adaptive_grad_clip_matches_reference(pg, clipping, eps) -> None:
    params, grads = pg
    out = _update(functopt.adaptive_grad_clip(clipping, eps), grads, params)
    for g, p, o in zip(_leaves(grads), _leaves(params), _leaves(out), strict=True):
        if g is None:
            assert o is None
        else:
            _assert_matches(o, _agc_reference(g, p, clipping, eps))


def test_adaptive_grad_clip_units_are_output_rows_in_pytorch_layout() -> None:
    linear = torch.nn.Linear(3, 2)  # weight (out=2, in=3)
    params = {"weight": torch.tensor([[1.0, 0.0, 0.0], [0.0, 10.0, 0.0]])}
    grads = {"weight": torch.tensor([[0.0, 2.0, 0.0], [0.0, 0.0, 2.0]])}
    assert linear.weight.shape == params["weight"].shape
    tx = functopt.adaptive_grad_clip(1.0)
    out = tx.update(grads, tx.init(params), params)[0]["weight"]
    # Row 0: |g| = 2 > 1 * |p| = 1, clipped to norm 1. Row 1: |g| = 2 < 10, kept.
    torch.testing.assert_close(out, torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]]))


def test_adaptive_grad_clip_treats_a_column_shaped_leaf_as_one_unit() -> None:
    # As optax: a tensor with one dim longer than 1, such as (3, 1), is a vector: one unit.
    params = {"w": torch.tensor([[3.0], [4.0], [0.0]])}  # norm 5
    grads = {"w": torch.tensor([[0.0], [0.0], [2.0]])}  # norm 2 < 0.5 * 5: kept as a whole
    tx = functopt.adaptive_grad_clip(0.5)
    out = tx.update(grads, tx.init(params), params)[0]["w"]
    assert torch.equal(out, grads["w"])


def test_adaptive_grad_clip_axis_selects_the_reduction_dims() -> None:
    gen = torch.Generator().manual_seed(3)
    p = torch.randn(4, 3, generator=gen, dtype=torch.float64)
    g = 5 * torch.randn(4, 3, generator=gen, dtype=torch.float64)
    tx_rows = functopt.adaptive_grad_clip(0.5)
    tx_cols = functopt.adaptive_grad_clip(0.5, axis=0)  # optax's default for 2-d kernels
    by_rows = tx_rows.update({"w": g}, tx_rows.init({"w": p}), {"w": p})[0]["w"]
    by_cols = tx_cols.update({"w": g}, tx_cols.init({"w": p}), {"w": p})[0]["w"]
    torch.testing.assert_close(by_rows, _agc_reference(g, p, 0.5, 1e-3))
    torch.testing.assert_close(by_cols, _agc_reference(g.T, p.T, 0.5, 1e-3).T)


def test_adaptive_grad_clip_accepts_five_dim_conv3d_weights() -> None:
    gen = torch.Generator().manual_seed(4)
    p = torch.randn(2, 3, 2, 2, 2, generator=gen, dtype=torch.float64)
    g = 10 * torch.randn(2, 3, 2, 2, 2, generator=gen, dtype=torch.float64)
    tx = functopt.adaptive_grad_clip(0.1)
    out = tx.update({"w": g}, tx.init({"w": p}), {"w": p})[0]["w"]
    torch.testing.assert_close(out, _agc_reference(g, p, 0.1, 1e-3))


def test_adaptive_grad_clip_non_finite_unit_becomes_nan_and_others_are_kept() -> None:
    params = {"w": torch.ones(2, 2)}
    grads = {"w": torch.tensor([[math.inf, 0.0], [0.1, 0.1]])}
    tx = functopt.adaptive_grad_clip(1.0)
    out = tx.update(grads, tx.init(params), params)[0]["w"]
    assert out[0].isnan().all()
    assert torch.equal(out[1], grads["w"][1])


# ------------------------------------------------------------------ hyperparameters as tensors


@pytest.mark.parametrize(
    "make",
    [
        lambda v: functopt.clip(v),
        lambda v: functopt.clip_by_block_rms(v),
        lambda v: functopt.clip_by_global_norm(v),
        lambda v: functopt.adaptive_grad_clip(v),
    ],
    ids=["clip", "block_rms", "global_norm", "agc"],
)
def test_tensor_hyperparameters_give_the_number_results(make) -> None:
    gen = torch.Generator().manual_seed(5)
    params = {"w": torch.randn(3, 4, generator=gen), "b": torch.randn(3, generator=gen)}
    grads = {k: 3 * torch.randn(v.shape, generator=gen) for k, v in params.items()}
    outs = []
    for value in (0.3, torch.tensor(0.3, dtype=torch.float64)):
        tx = make(value)
        outs.append(tx.update(grads, tx.init(params), params)[0])
    for key in params:
        assert outs[1][key].dtype == torch.float32
        torch.testing.assert_close(outs[0][key], outs[1][key])


# ------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: functopt.clip(-1.0), ValueError, r"clip: max_delta must be in \[0, inf\), got -1.0"),
        (lambda: functopt.clip("1"), TypeError, r"clip: max_delta must be a number or a 0-d tensor"),
        (lambda: functopt.clip_by_block_rms(0.0), ValueError, r"threshold must be in \(0, inf\)"),
        (lambda: functopt.clip_by_global_norm(0.0), ValueError, r"max_norm must be in \(0, inf\), got 0.0"),
        (lambda: functopt.clip_by_global_norm(math.nan), ValueError, r"max_norm must be in"),
        (lambda: functopt.clip_by_global_norm(torch.ones(2)), TypeError, r"0-d tensor, got a tensor of shape \(2,\)"),
        (lambda: functopt.adaptive_grad_clip(-0.1), ValueError, r"adaptive_grad_clip: clipping must be in \[0, inf\)"),
        (lambda: functopt.adaptive_grad_clip(0.1, eps=-1.0), ValueError, r"eps must be in \[0, inf\)"),
        (lambda: functopt.adaptive_grad_clip(0.1, axis="rows"), TypeError, r"axis must be None, an int or a non-empty tuple of ints, got 'rows'"),
        (lambda: functopt.adaptive_grad_clip(0.1, axis=()), TypeError, r"non-empty tuple"),
    ],
)
def test_bad_hyperparameters_are_rejected(make, error, match) -> None:
    with pytest.raises(error, match=match):
        make()


def test_adaptive_grad_clip_needs_params() -> None:
    tx = functopt.adaptive_grad_clip(0.1)
    with pytest.raises(ValueError, match=r"adaptive_grad_clip reads the params, but update\(\) was called without them"):
        tx.update({"w": torch.ones(2)}, tx.init(None))


def test_adaptive_grad_clip_names_the_leaf_whose_param_is_missing() -> None:
    tx = functopt.adaptive_grad_clip(0.1)
    with pytest.raises(ValueError, match=r"leaf 'layer.bias' has an update but its param is None"):
        tx.update({"layer": {"bias": torch.ones(2)}}, tx.init(None), {"layer": {"bias": None}})


def test_adaptive_grad_clip_names_the_leaf_an_axis_does_not_fit() -> None:
    tx = functopt.adaptive_grad_clip(0.1, axis=(1, 2))
    params = {"conv": torch.ones(2, 2, 2), "bias": torch.ones(2)}
    with pytest.raises(ValueError, match=r"axis=\(1, 2\) does not fit leaf 'bias' of shape \(2,\)"):
        tx.update(params, tx.init(params), params)


def test_clipping_rejects_integer_updates_by_path() -> None:
    tx = functopt.clip_by_global_norm(1.0)
    with pytest.raises(TypeError, match=r"updates leaf 'steps' is a int64 tensor"):
        tx.update({"steps": torch.ones(2, dtype=torch.int64)}, tx.init(None))


def test_clip_by_global_norm_of_a_subnormal_norm_is_finite() -> None:
    # 1 / 4.6e-41 overflows float32; the clip factor must not go through that reciprocal.
    g = {"w": torch.tensor([4.5918e-41])}
    out, _ = functopt.clip_by_global_norm(4.6e-44).update(g, functopt.EmptyState())
    assert torch.isfinite(out["w"]).all()
    torch.testing.assert_close(out["w"], torch.tensor([4.6e-44]), rtol=0.1, atol=0.0)
