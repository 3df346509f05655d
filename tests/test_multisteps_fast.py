"""``make_step(MultiSteps(...))``: foreach accumulation in the caller's state, the inner
transform's fast step when a window closes, MultiSteps' skip and guard semantics kept."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functopt
from functopt.testing import assert_bitwise_equal, conformance
from functopt.testing import strategies as fst

F = functopt

INNER: dict[str, Callable[[], functopt.GradientTransformation]] = {
    "adamw": lambda: F.adamw(1e-2, weight_decay=0.1),
    "adam": lambda: F.adam(1e-2),
    "sgd": lambda: F.sgd(0.1, momentum=0.9),
    "clip+adamw": lambda: F.chain(F.clip_by_global_norm(0.05), F.adamw(1e-2)),
    "apply_if_finite": lambda: F.apply_if_finite(F.adamw(1e-2), max_consecutive_errors=1),
}


def _grads(seed: int, n: int, params: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [{k: torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in params.items()}
            for _ in range(n)]


def _params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"w": torch.randn(5, 3, generator=gen),
            "c": torch.randn(2, 3, 2, 2, generator=gen).contiguous(
                memory_format=torch.channels_last),
            "b": torch.randn(3, generator=gen, dtype=torch.float64)}


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("inner", list(INNER), ids=list(INNER))
def test_fast_equals_pure_and_is_the_inner_kernel_step(k: int, inner: str) -> None:
    params = _params()
    ms = F.MultiSteps(INNER[inner](), every_k_schedule=k)
    assert F.fast.explain(ms, params).fast  # no FastPathWarning below (warnings are errors)
    grads = _grads(k, 2 * k + 1, params)
    state = ms.init(params)
    step = F.fast.make_step(ms, donate=True)
    inner_step = F.fast.make_step(INNER[inner]())
    fast_p, fast_s = {n: t.clone() for n, t in params.items()}, ms.init(params)
    ref_p, ref_inner = dict(params), state.inner_opt_state  # the inner fast step by hand
    window: list[dict[str, torch.Tensor]] = []
    accs = [fast_s.acc_grads[n] for n in params]
    for g in grads:
        updates, state = ms.update(g, state, params)
        pure_p = F.apply_updates(params, updates)
        with torch.no_grad():
            fast_p, fast_s = step(g, fast_s, fast_p)
        window.append(g)
        if len(window) == k:  # the inner kernel step on the window's running mean
            mean = {n: _running_mean([w[n] for w in window]) for n in params}
            with torch.no_grad():
                ref_p, ref_inner = inner_step(mean, ref_inner, ref_p)
            window = []
        for n in params:  # bitwise the inner fast step: same accumulation, same kernel
            assert torch.equal(fast_p[n], ref_p[n]), (n, len(window))
            torch.testing.assert_close(fast_p[n], pure_p[n], rtol=1e-5, atol=1e-7)
        assert int(fast_s.mini_step) == int(state.mini_step)
        assert int(fast_s.gradient_step) == int(state.gradient_step)
        # the accumulators are the caller's state, written in place (no hidden buffers)
        assert all(fast_s.acc_grads[n] is a for n, a in zip(params, accs, strict=True))
        params = pure_p


def _running_mean(gs: list[torch.Tensor]) -> torch.Tensor:
    if len(gs) == 1:
        return gs[0]
    acc = torch.zeros_like(gs[0])
    for i, g in enumerate(gs):
        acc = acc + (g - acc) / (i + 1)
    return acc


@pytest.mark.parametrize("use_grad_mean", [True, False])
def test_accumulators_are_bitwise_the_pure_ones(use_grad_mean: bool) -> None:
    params = {"h": torch.randn(4, 3, dtype=torch.bfloat16), "f": torch.randn(3, 2)}
    ms = F.MultiSteps(F.sgd(0.1), every_k_schedule=4, use_grad_mean=use_grad_mean)
    state = fast = ms.init(params)
    step = F.fast.make_step(ms)
    for g in _grads(1, 3, params):
        _, state = ms.update(g, state, params)
        with torch.no_grad():
            new_params, fast = step(g, fast, params)
        assert all(torch.equal(new_params[n], params[n]) for n in params)
        assert_bitwise_equal(fast, state)


def test_skip_function_and_inner_guard_keep_their_semantics() -> None:
    params = _params()
    inner = F.apply_if_finite(F.adamw(1e-2), max_consecutive_errors=3)
    ms = F.MultiSteps(inner, every_k_schedule=2, should_skip_update_fn=F.skip_not_finite)
    grads = _grads(2, 6, params)
    grads[1]["w"][0, 0] = float("nan")  # skipped by should_skip_update_fn
    state, fast, fast_p = ms.init(params), ms.init(params), dict(params)
    step = F.fast.make_step(ms)
    for g in grads:
        updates, state = ms.update(g, state, params)
        params = F.apply_updates(params, updates)
        with torch.no_grad():
            fast_p, fast = step(g, fast, fast_p)
        assert int(fast.mini_step) == int(state.mini_step)
        assert_bitwise_equal(fast.skip_state, state.skip_state)
        assert_bitwise_equal(fast.acc_grads, state.acc_grads)
        for n in params:
            torch.testing.assert_close(fast_p[n], params[n], rtol=1e-5, atol=1e-7)
    # an overflow the skip function lets through reaches apply_if_finite, which skips
    ms = F.MultiSteps(inner, every_k_schedule=1)
    bad = {n: torch.full_like(t, float("inf")) for n, t in params.items()}
    updates, state = ms.update(bad, ms.init(params), params)
    with torch.no_grad():
        new_p, fast = F.fast.make_step(ms)(bad, ms.init(params), params)
    assert all(torch.equal(new_p[n], params[n]) for n in params)
    assert_bitwise_equal(fast.inner_opt_state.notfinite_count,
                                     state.inner_opt_state.notfinite_count)


def test_donated_tied_params_are_refused() -> None:
    w = torch.randn(3)
    ms = F.MultiSteps(F.adamw(1e-2), every_k_schedule=2)
    params = {"a": w, "b": w}
    with pytest.raises(ValueError, match="share memory"):
        F.fast.make_step(ms, donate=True)({"a": torch.ones(3), "b": torch.ones(3)},
                                          ms.init(params), params)


def test_explain_names_the_inner_reason_and_nesting_warns() -> None:
    params = {"w": torch.zeros(3)}
    got = F.fast.explain(F.MultiSteps(F.lion(1e-4), every_k_schedule=2), params)
    assert not got.fast and "MultiSteps' inner transform" in (got.reason or "")
    masked = F.masked(F.MultiSteps(F.adamw(1e-2), 2).gradient_transformation(), {"w": True})
    # make_step and the mixed step lower one in a chain (tests/test_multisteps_nested.py),
    # make_step one inside masked too (tests/test_multisteps_inside.py), the mixed step not
    nested = F.chain(F.MultiSteps(F.adamw(1e-2), 2).gradient_transformation())
    assert F.fast.explain(nested, params).fast
    assert F.fast.explain(masked, params).fast
    opt = F.precision.mixed_precision(masked)
    with pytest.warns(F.fast.FastPathWarning, match="lowered by make_step only"):
        opt.step({"w": torch.ones(3)}, opt.init(params), params)


@settings(max_examples=6, deadline=None)
@given(case=conformance.cases(dtypes=(torch.float32, torch.float64), max_leaves=3),
       k=st.sampled_from([1, 2, 3]), inner=st.sampled_from(sorted(INNER)))
def test_fast_path_law_over_every_layout(case: tuple[Any, Any, Any], k: int,
                                         inner: str) -> None:
    params, grads, _ = case
    conformance.check_fast_path(lambda: F.MultiSteps(INNER[inner](), every_k_schedule=k),
                                params, grads, steps=k + 1)


def test_strategies_reach_the_layouts() -> None:
    # (what the law above runs over)
    x = fst.laid_out(torch.arange(24.0).reshape(2, 3, 2, 2), "channels_last")
    assert x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    assert not fst.laid_out(torch.ones(3, 2), "sliced").is_contiguous()
