"""Adafactor and block-RMS clipping on the planner's per-leaf tier (functopt/fast/_perleaf.py).

``scale_by_factored_rms`` (Adafactor's factored moments), ``clip_by_block_rms`` and
``scale_by_param_block_rms`` reduce within a leaf: they carry a ``PerLeaf`` spec, and the
first two a grouped update (foreach ops over a group's unfactored leaves, same-shape
factored leaves stacked in their own layout, every block norm in one
``torch._foreach_norm`` call). The references are the pure transforms (``update`` then
``apply_updates``; their own values are held to optax in tests/test_factored.py and
tests/test_clipping.py). The grouped updates run the pure path's elementwise operations
and reductions in the leaves' own order, so the tier is held bitwise to it here; the
conformance law (tolerance) is checked on the layouts the strategies draw.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_perleaf_fast import (  # (the pure step, and a fast step that must not fall back)
    _fast,
    _pure,
)

import functopt
from functopt.fast import FastPathWarning
from functopt.precision import mixed_precision
from functopt.testing import assert_bitwise_equal, clone_tree, conformance
from functopt.transforms import factored as factored_module

ADAFACTOR_RULES = ("scale_by_factored_rms", "clip_by_block_rms", "scale_by_learning_rate",
                   "scale_by_param_block_rms", "scale")


def _model(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """Same-shape matrices (one stacked batch), two transposed ones (a batch in their
    layout), channels_last and strided pairs, 3-D leaves, a wide matrix, an empty matrix,
    vectors, a 0-d scalar and an empty vector."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    return {"a": r(6, 4), "b": r(6, 4), "c": r(6, 4), "t": r(4, 6).T, "t2": r(4, 6).T,
            "cl": r(2, 3, 4, 5).to(memory_format=torch.channels_last),
            "cl2": r(2, 3, 4, 5).to(memory_format=torch.channels_last),
            "s": r(6, 8)[:, ::2], "s2": r(6, 8)[:, ::2], "d3": r(3, 4, 5), "d3b": r(3, 4, 5),
            "wide": r(3, 7), "empty": r(0, 5), "bias": r(4), "bias2": r(4), "scale": r(()),
            "none": r(0)}


def _grads_like(params: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Random gradients laid out densely like their params (empty_like)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in params.items():
        x = torch.empty_like(v)
        x.copy_(torch.randn(v.shape, generator=g, dtype=torch.float64))
        out[k] = x
    return out


def _steps(tx: Any, params: Any, *, steps: int = 3, donate: bool = False,
           frozen: tuple[str, ...] = ()) -> None:
    """``steps`` steps of the fast and the pure path from the same start: bitwise equal
    params and state."""
    step = functopt.fast.make_step(tx, donate=donate)
    pure_p, pure_s = params, tx.init(params)
    fast_p, fast_s = clone_tree(params), tx.init(params)  # (strided leaves stay strided)
    for i in range(steps):
        grads: dict[str, Any] = dict(_grads_like(params, 10 + i))
        grads.update({k: None for k in frozen})
        pure_p, pure_s = _pure(tx, grads, pure_s, pure_p)
        before = fast_p
        fast_p, fast_s = _fast(step, grads, fast_s, fast_p)
        if donate:
            assert all(fast_p[k] is before[k] for k in params)
    assert_bitwise_equal(fast_p, pure_p)
    assert_bitwise_equal(fast_s, pure_s)
    for k in frozen:
        assert torch.equal(fast_p[k], params[k]), k


def test_explain_puts_adafactor_and_block_rms_clipping_on_the_tier() -> None:
    params = _model(torch.float32)
    got = functopt.fast.explain(functopt.adafactor(1e-2), params)
    assert got.fast and got.reason is None
    assert [(g.kernel, g.rules) for g in got.groups] == [("per-leaf", ADAFACTOR_RULES)]
    assert set(got.groups[0].leaves) == set(params)
    # momentum and masked decay: ema and the masked add_decayed_weights split the leaves
    # into two groups, both on the tier
    masked = functopt.fast.explain(functopt.adafactor(
        1e-2, momentum=0.9, weight_decay_rate=0.1,
        weight_decay_mask=lambda p: {k: v.dim() > 1 for k, v in p.items()}), params)
    assert masked.fast and {g.kernel for g in masked.groups} == {"per-leaf"}
    assert {g.rules for g in masked.groups} == {
        (*ADAFACTOR_RULES[:-1], "ema", "add_decayed_weights", "scale"),
        (*ADAFACTOR_RULES[:-1], "ema", "scale")}
    clipped = functopt.fast.explain(functopt.chain(functopt.clip_by_block_rms(1.0),
                                                   functopt.adam(1e-3)), params)
    assert clipped.fast and [(g.kernel, g.rules) for g in clipped.groups] == [
        ("per-leaf", ("clip_by_block_rms", "scale_by_adam", "scale_by_learning_rate"))]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("build", [
    lambda: functopt.adafactor(0.05, min_dim_size_to_factor=2),
    lambda: functopt.adafactor(0.05, min_dim_size_to_factor=4, momentum=0.9,
                               weight_decay_rate=0.1, clipping_threshold=0.3),
    lambda: functopt.adafactor(0.05, factored=False, clipping_threshold=None,
                               multiply_by_parameter_scale=False),
    lambda: functopt.chain(functopt.scale_by_factored_rms(
        decay_rate=torch.tensor(0.5), epsilon=torch.tensor(1e-3), step_offset=-2,
        min_dim_size_to_factor=2), functopt.clip_by_block_rms(torch.tensor(0.7)),
        functopt.scale(-0.1)),
    lambda: functopt.chain(functopt.scale_by_factored_rms(
        min_dim_size_to_factor=0, decay_rate_fn=lambda step, rate: 0.9), functopt.scale(-0.1)),
], ids=["factored", "momentum,decay,threshold", "unfactored", "tensor hyperparameters",
        "a number decay, every leaf factored"])
def test_adafactor_fast_equals_pure_bitwise_over_layouts(build: Any, dtype: torch.dtype) -> None:
    # stacked batches (a, b, c; t, t2; cl, cl2; d3, d3b), leaves alone (strided, wide,
    # empty), foreach over the unfactored ones; min_dim_size_to_factor=4 leaves the 3-row
    # matrices unfactored
    _steps(build(), _model(dtype))


@pytest.mark.parametrize("donate", [False, True])
def test_donated_and_leaves_without_a_gradient(donate: bool) -> None:
    # a None gradient leaves its param and statistics as they were, in a batch and alone
    tx = functopt.adafactor(0.05, min_dim_size_to_factor=2, momentum=0.9)
    _steps(tx, _model(torch.float64), donate=donate, frozen=("b", "bias", "wide"))


def test_block_rms_clipping_in_any_chain_equals_pure_bitwise() -> None:
    tx = functopt.chain(functopt.clip_by_block_rms(0.5), functopt.adamw(1e-2))
    _steps(tx, _model(torch.float32))
    _steps(functopt.chain(functopt.clip_by_block_rms(2.0), functopt.sgd(0.1, momentum=0.9)),
           _model(torch.bfloat16))


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.sampled_from([0, 1, 3, 7]), min_size=1, max_size=6),
       dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.float16]),
       threshold=st.sampled_from([1e-3, 0.5, 1.0, 1e3]),
       bad=st.sampled_from([None, float("inf"), float("nan")]), seed=st.integers(0, 2**16))
def test_grouped_block_rms_is_bitwise_the_per_leaf_clip(sizes: list[int], dtype: torch.dtype,
                                                        threshold: float, bad: float | None,
                                                        seed: int) -> None:
    # the grouped update (one foreach norm, the scales as one vector) against the pure
    # update, leaf for leaf: 0-d, empty and non-finite leaves (nan leaf by leaf) included
    g = torch.Generator().manual_seed(seed)
    updates: dict[str, Any] = {
        f"u{i}": (torch.randn(n, 2, generator=g, dtype=torch.float64) * 3).to(dtype)
        for i, n in enumerate(sizes)}
    updates["zero_d"] = torch.tensor(5.0, dtype=dtype)
    updates["missing"] = None
    if bad is not None and updates["u0"].numel():
        updates["u0"][0, 0] = bad
    tx = functopt.clip_by_block_rms(threshold)
    spec = functopt._spec.describe(tx)
    assert isinstance(spec, functopt._spec.PerLeaf) and spec.grouped is not None
    grouped, _ = spec.grouped(updates, tx.init(None))
    pure, _ = tx.update(updates, tx.init(None))
    assert_bitwise_equal(grouped, pure)
    if bad is not None and updates["u0"].numel():
        assert bool(grouped["u0"].isnan().all())


def test_same_shape_factored_leaves_run_as_cache_sized_batches(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    real = factored_module._factored_batch

    def counting(gs: list[torch.Tensor], *args: Any) -> Any:
        seen.append(len(gs))
        return real(gs, *args)

    monkeypatch.setattr(factored_module, "_factored_batch", counting)
    monkeypatch.setitem(factored_module._BATCH_ELEMENTS, "cpu", 3 * 24)  # three 6 x 4 matrices
    params = {f"m{i}": torch.randn(6, 4, dtype=torch.float64) for i in range(7)}
    params["t"] = torch.randn(4, 6, dtype=torch.float64).T  # another layout: alone
    tx = functopt.adafactor(0.05, min_dim_size_to_factor=2)
    grads = _grads_like(params, 3)
    new, _ = _fast(functopt.fast.make_step(tx), grads, tx.init(params), params)
    # 7 matrices in batches of at most 3; the seventh and t (another layout) leaf by leaf
    assert seen == [3, 3]
    assert_bitwise_equal(new, _pure(tx, grads, tx.init(params), params)[0])
    seen.clear()
    tx.update(grads, tx.init(params), params)
    assert not seen  # the pure path: leaf by leaf


def test_batches_are_cache_sized_on_the_cpu_and_larger_elsewhere() -> None:
    # fifty 256 x 256 matrices: batches of 4 (2^18 elements) on the CPU; on another
    # device type the batches are larger (fewer launches): all 50 in one
    meta = [torch.empty(256, 256, device="meta")] * 50
    key = ((0, 1), meta[0].device, (torch.float32,) * 4, (256, 256), (256, 1))
    assert [len(i) for _, i in factored_module._chunked({key: list(range(50))}, meta)] == [50]
    cpu = [torch.empty(256, 256)] * 50
    assert [len(i) for _, i in factored_module._chunked({key: list(range(50))}, cpu)] == [4] * 12 + [2]


@settings(max_examples=6, deadline=None)
@given(case=conformance.cases(max_leaves=5, grad_kind="finite"),
       min_dim=st.sampled_from([0, 1, 2, 3, 128]), factored=st.booleans(),
       momentum=st.sampled_from([None, 0.9]), threshold=st.sampled_from([None, 0.5, 1.0]),
       parameter_scale=st.booleans(), decay_rate=st.sampled_from([0.8, 0.5]))
def test_fast_path_law_on_drawn_layouts(case: Any, min_dim: int, factored: bool,
                                        momentum: float | None, threshold: float | None,
                                        parameter_scale: bool, decay_rate: float) -> None:
    # channels_last, transposed, sliced, 0-d, empty and tied leaves, grads laid out unlike
    # their params; every option of the recipe that changes what the rules compute
    params, grads, mask = case

    def build() -> functopt.GradientTransformation:
        return functopt.adafactor(
            0.03, min_dim_size_to_factor=min_dim, factored=factored, momentum=momentum,
            clipping_threshold=threshold, multiply_by_parameter_scale=parameter_scale,
            decay_rate=decay_rate, weight_decay_rate=0.01, weight_decay_mask=mask)

    assert functopt.fast.explain(build(), params).fast
    conformance.check_fast_path(build, params, grads, steps=2)
    conformance.check_fast_path(lambda: functopt.chain(functopt.clip_by_block_rms(0.5),
                                                       functopt.adamw(1e-2)),
                                params, grads, steps=2)


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(case=conformance.cases(max_leaves=6), min_dim=st.sampled_from([0, 1, 2, 128]),
       momentum=st.sampled_from([None, 0.9]), threshold=st.sampled_from([None, 0.5]))
def test_fast_path_law_on_drawn_layouts_deep(case: Any, min_dim: int, momentum: float | None,
                                             threshold: float | None) -> None:
    params, grads, _ = case
    conformance.check_fast_path(lambda: functopt.adafactor(
        0.03, min_dim_size_to_factor=min_dim, momentum=momentum,
        clipping_threshold=threshold), params, grads, steps=3)


def test_a_skipped_step_keeps_params_and_state() -> None:
    tx = functopt.apply_if_finite(functopt.adafactor(0.05, min_dim_size_to_factor=2),
                                  max_consecutive_errors=3)
    params = _model(torch.float64)
    state = tx.init(params)
    grads = _grads_like(params, 7)
    grads["a"][0, 0] = float("inf")
    before = clone_tree(params)
    fast_p, fast_s = _fast(functopt.fast.make_step(tx, donate=True), grads,
                           functopt.tree.map(torch.clone, state), params)
    pure_p, pure_s = _pure(tx, grads, state, before)
    assert_bitwise_equal(fast_p, before)
    assert_bitwise_equal(fast_p, pure_p)
    assert_bitwise_equal(fast_s, pure_s)
    assert int(fast_s.notfinite_count) == 1


def _mixed_steps(build: Any, full: dict[str, torch.Tensor], *, steps: int, seed: int,
                 overflow_at: int | None = None) -> tuple[Any, Any, Any]:
    """``steps`` steps of ``mixed_precision(build(), max_grad_norm=1.0)``, fused (without
    a FastPathWarning) and pure, from the bf16 params ``full``, the gradients drawn from
    ``seed + step``; at ``overflow_at`` an inf, which both skip (the fused masters kept
    bitwise). Returns the fused params and state, and the pure state."""
    fast = mixed_precision(build(), max_grad_norm=1.0)
    pure = mixed_precision(build(), max_grad_norm=1.0, fused=False)
    fp, fs = full, fast.init(full)
    pp, ps = full, pure.init(full)
    for i in range(steps):
        grads = {k: v.to(torch.bfloat16) for k, v in _grads_like(
            {k: v.float() for k, v in full.items()}, seed + i).items()}
        if i == overflow_at:
            grads["a"][1, 1] = float("inf")
        masters = {k: v.clone() for k, v in fs.master.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("error", FastPathWarning)
            fp, fs = fast.step(grads, fs, fp)
        pp, ps = pure.step(grads, ps, pp)
        if i == overflow_at:
            assert_bitwise_equal(fs.master, masters)
    return fp, fs, ps


@pytest.mark.parametrize("momentum", [None, 0.9])
def test_mixed_precision_adafactor_takes_the_tier(momentum: float | None) -> None:
    full = {k: v.to(torch.bfloat16) for k, v in _model(torch.float32).items()
            if k not in ("s", "s2")}  # (bf16 params come dense from the model's float32)

    def build() -> functopt.GradientTransformation:
        return functopt.adafactor(0.02, min_dim_size_to_factor=2, momentum=momentum,
                                  weight_decay_rate=0.01)

    fp, fs, ps = _mixed_steps(build, full, steps=4, seed=20, overflow_at=2)
    # bitwise where the leaf is contiguous; the mixed step hands the rules the gradients of
    # a transposed or channels_last leaf laid out as its master, so a factored mean there
    # may sum in another order than on the pure mixed path (measured: 1 ulp in v_row)
    dense = {k for k, v in full.items() if v.is_contiguous()}
    assert {"a", "b", "c", "d3", "bias"} <= dense
    assert_bitwise_equal({k: fs.master[k] for k in dense}, {k: ps.master[k] for k in dense})
    torch.testing.assert_close(fs.master, ps.master, rtol=4 * torch.finfo(torch.float32).eps,
                               atol=0)
    for k, p in fp.items():
        assert p.dtype == torch.bfloat16
        assert torch.equal(fs.master[k].to(torch.bfloat16), p), k


def test_factored_rms_alone_and_param_block_rms_take_the_tier() -> None:
    params = _model(torch.float32)
    for tx in (functopt.scale_by_factored_rms(min_dim_size_to_factor=2),
               functopt.chain(functopt.scale_by_param_block_rms(), functopt.scale(-0.1)),
               functopt.chain(functopt.scale_by_param_block_norm(), functopt.scale(-0.1))):
        assert functopt.fast.explain(tx, params).fast
        _steps(tx, params, steps=2)


def test_ema_alone_has_no_kernel_and_says_so() -> None:
    # ema is elementwise (the compiled tier's, with compile=True): without a per-leaf rule
    # beside it, it does not enter the per-leaf tier
    got = functopt.fast.explain(functopt.ema(0.9), {"w": torch.zeros(3)})
    assert not got.fast and "per-leaf" not in str(got.reason)
    assert "ema" in str(got.reason)


# (what the tier refuses for adafactor: tests/test_perleaf_fast.py, beside Muon's)


@pytest.mark.slow
# (importing Inductor on the CPU defines torch.utils.mkldnn's ScriptModules, which warn)
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_ema_is_elementwise_and_compiles() -> None:
    # ema's spec names its per-leaf average: with compile=True it takes the compiled tier
    params = {"w": torch.randn(4, 3, dtype=torch.float64), "b": torch.randn(3, dtype=torch.float64)}
    grads = {k: torch.randn_like(v) for k, v in params.items()}

    def build() -> functopt.GradientTransformation:
        return functopt.chain(functopt.ema(0.9), functopt.scale(-0.1))

    explained = functopt.fast.explain(build(), params, compile=True)
    assert explained.fast and [g.kernel for g in explained.groups] == ["compiled"]
    conformance.check_fast_path(build, params, grads, steps=2, compile=True)
