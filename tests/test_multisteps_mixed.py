"""``mixed_precision(MultiSteps(inner, k).gradient_transformation())`` on the fast path: held
to the pure mixed step (``fused=False``), the law, step by step from the same inputs.

On a mini-step the two make the same operations (cast, unscale, statistics, clip, the
running mean, masters plus 0.0): bitwise. On a closing mini-step the fast step runs the
inner rule on PyTorch's fused kernel: masters and moments to rounding, params bitwise the
rounded masters. An overflow (on a mini-step or on a closing one) changes nothing but the
loss scale and the metrics, bitwise.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from compiled_cases import every_layout, grads_for
from hypothesis import given, settings
from hypothesis import strategies as st

import functopt
from functopt.testing import assert_bitwise_equal, conformance
from functopt.tree import _core

F = functopt
P = functopt.precision

INNER: dict[str, Callable[[], functopt.GradientTransformation]] = {
    "adamw": lambda: F.adamw(1e-2, weight_decay=0.1),
    "clip+adamw": lambda: F.chain(F.clip_by_global_norm(0.05), F.adamw(1e-2)),
}


# a MultiSteps in the inner chain: the chain around it, and its state's place there
NESTINGS: dict[str, tuple[Callable[[Any], Any], tuple[int, ...]]] = {
    "clip, ms": (lambda ms: F.chain(F.clip_by_global_norm(0.05), ms), (1,)),
    "ms, decay, lr": (lambda ms: F.chain(ms, F.add_decayed_weights(0.1),
                                         F.scale_by_learning_rate(1e-2)), (0,)),
}


def _params() -> dict[str, torch.Tensor]:
    tree = every_layout(torch.bfloat16)
    tree["f32"] = torch.randn(3, 2, generator=torch.Generator().manual_seed(5))  # own master
    tree["b"][0] = tree["f32"][0, 0] = -0.0  # a zero update makes them 0.0 (bitwise checked)
    return tree


def _scaled_grads(params: dict[str, torch.Tensor], n: int, scale: float,
                  overflow: set[int]) -> list[dict[str, torch.Tensor]]:
    out = []
    for t in range(n):
        g = {k: (v.float() * scale).to(v.dtype) for k, v in grads_for(params, t).items()}
        if t in overflow:
            g["w"][1, 2] = float("inf")
        out.append(g)
    return out


def _leaves(tree: Any) -> list[Any]:
    return _core.flatten(tree)[0]  # (None leaves included)


def _strides(t: torch.Tensor) -> list[int]:
    # (the strides that place elements: none for an empty tensor, none of a size-1 dim)
    return [s for s, n in zip(t.stride(), t.shape, strict=True) if n > 1 and t.numel()]


def _check_step(k: int, inner: str, donate: bool, max_grad_norm: float | None,
                overflow: set[int], steps: int, scale: float = 2.0**10,
                count_zeros: bool = True, **options: Any) -> set[bool]:
    params = _params()
    found, closed = _compare(F.MultiSteps(INNER[inner](), every_k_schedule=k, **options),
                             params, _scaled_grads(params, steps, scale, overflow),
                             donate=donate, max_grad_norm=max_grad_norm, scale=scale,
                             count_zeros=count_zeros)
    assert {t for t, (f, _) in enumerate(found) if f} == overflow
    assert closed >= 1
    return {c for f, c in found if f}  # whether each overflow was on a closing mini-step


def _compare(ms: F.MultiSteps, params: Any, grads: list[Any], *, donate: bool,
             max_grad_norm: float | None, scale: float, allow_lost: bool = False,
             count_zeros: bool = True, compile: bool = False,
             around: Callable[[Any], Any] | None = None, at: tuple[int, ...] = (),
             ) -> tuple[list[tuple[bool, bool]], int]:
    """Step the fast and the pure mixed step from the same inputs at every step (the pure
    results go on); returns, per step, (overflowed, would have closed its window), and the
    number of windows closed. Without ``allow_lost`` the fast step must not warn that it
    lost its fast path. ``around``: the inner transform is ``around(ms)`` (a chain holding
    it, its state at ``at`` in the chain's)."""

    def ms_of(s: Any) -> Any:
        for key in at:
            s = s[key]
        return s

    def inner() -> Any:
        tx = ms.gradient_transformation()
        return tx if around is None else around(tx)

    kwargs: dict[str, Any] = dict(
        loss_scale=None if scale == 1 else F.dynamic_loss_scale(init_scale=scale),
        max_grad_norm=max_grad_norm, count_zeros=count_zeros)
    fast = P.mixed_precision(inner(), donate=donate, compile=compile, **kwargs)
    pure = P.mixed_precision(inner(), fused=False, **kwargs)
    state = pure.init(params)
    assert_bitwise_equal(fast.init(params), state)
    closed, found_at = 0, []
    for g in grads:
        mine_p, mine_s = copy.deepcopy((params, state))  # donation may overwrite them
        given = copy.deepcopy(g)
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", F.fast.FastPathWarning)  # (others: as configured)
            new_p, new_s = fast.step(g, mine_s, mine_p)
        lost = [w for w in caught if issubclass(w.category, F.fast.FastPathWarning)]
        assert allow_lost or not lost, [str(w.message) for w in lost]
        assert_bitwise_equal(g, given)  # gradients are never written
        ref_p, ref_s = pure.step(g, state, params)
        found = bool(ref_s.metrics.found_inf)
        ms_state, new_ms, ref_ms = (ms_of(x.inner_state) for x in (state, new_s, ref_s))
        would_close = int(ms_state.mini_step) + 1 == ms._k_steps(ms_state.gradient_step)
        found_at.append((found, would_close))
        # the loss scale, the metrics, the key and MultiSteps' counters and accumulators:
        # the same operations on the same values, bitwise on every step
        assert_bitwise_equal(new_s.loss_scale, ref_s.loss_scale)
        assert_bitwise_equal(new_s.metrics, ref_s.metrics)
        assert_bitwise_equal(new_s.key, ref_s.key)
        for field in ("mini_step", "gradient_step", "acc_grads", "skip_state"):
            assert_bitwise_equal(getattr(new_ms, field), getattr(ref_ms, field))
        if not found and would_close and int(ref_ms.mini_step) == 0:
            closed += 1  # the inner kernel step: masters and moments to rounding
            torch.testing.assert_close(new_s.master, ref_s.master, rtol=4e-7, atol=1e-8)
            torch.testing.assert_close(new_s.inner_state, ref_s.inner_state,
                                       rtol=1e-6, atol=1e-9)
            new_leaves, masters = _leaves(new_p), _leaves(new_s.master)
            for p, m in zip(new_leaves, masters, strict=True):
                # each low-precision param is its new master rounded
                assert m is None or torch.equal(p, m.to(p.dtype))
            torch.testing.assert_close(new_p, ref_p, rtol=1e-2, atol=1e-6)
        else:  # a mini-step, a skipped one, or an overflow: bitwise
            assert_bitwise_equal(new_s.master, ref_s.master)
            assert_bitwise_equal(new_s.inner_state, ref_s.inner_state)
            assert_bitwise_equal(new_p, ref_p)
        for p, q in zip(_leaves(new_p), _leaves(ref_p), strict=True):
            # the pure layouts (a donated param is written in place, in its own layout,
            # and a skipped step gives the params back as they were given)
            assert p is None or (p.dtype == q.dtype and (
                donate or found or _strides(p) == _strides(q)))
        if donate and not found and not lost:  # in place (the pure path never writes)
            assert all(a is b for a, b in zip(_leaves(new_p), _leaves(mine_p),
                                              strict=True))
        params, state = ref_p, ref_s
    return found_at, closed


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("donate", [False, True])
def test_fast_mixed_multisteps_equals_the_pure_mixed_step(k: int, donate: bool) -> None:
    # overflows on the first mini-step of a window and on the step that would close the
    # second window
    closing = _check_step(k, "clip+adamw", donate, max_grad_norm=0.5, overflow={0, 2 * k},
                          steps=3 * k + 1)
    assert closing == ({False, True} if k > 1 else {True})


@pytest.mark.parametrize("k", [1, 2, 3])
def test_without_max_grad_norm(k: int) -> None:
    _check_step(k, "adamw", donate=False, max_grad_norm=None, overflow={k}, steps=2 * k + 1,
                count_zeros=False)


@pytest.mark.parametrize("donate", [False, True])
def test_inner_clip_measured_before_the_statistics(donate: bool) -> None:
    # no max_grad_norm, no skip function: a closing mini-step's inner clip measures the
    # accumulated gradients before the statistics' reduction (to pack them with it); an
    # overflow on a closing mini-step then discards them
    closing = _check_step(2, "clip+adamw", donate, max_grad_norm=None, overflow={3}, steps=6)
    assert closing == {True}


@pytest.mark.parametrize("k", [1, 2])
def test_no_loss_scale_and_a_skip_function(k: int) -> None:
    # the float32 param's gradient reaches the accumulation and the kernel uncast and
    # unscaled: the caller's tensor, read, never written (checked in _check_step)
    _check_step(k, "clip+adamw", donate=True, max_grad_norm=None, overflow={1},
                steps=2 * k + 1, scale=1.0, should_skip_update_fn=F.skip_not_finite)


def test_a_skip_function_that_rejects_finite_mini_steps() -> None:
    seen: list[bool] = []

    def positive_b(updates: Any, gradient_step: Any, params: Any) -> tuple[Any, Any]:
        skip = updates["b"][1] > 0  # a finite mini-step, rejected by its values
        seen.append(bool(skip))
        return skip, {"skipped": skip}

    _check_step(2, "adamw", donate=True, max_grad_norm=0.5, overflow=set(), steps=8,
                should_skip_update_fn=positive_b)
    assert True in seen and False in seen


@settings(max_examples=8, deadline=None)
@given(case=conformance.cases(dtypes=(torch.bfloat16, torch.float32), max_leaves=3,
                              tied=False),
       k=st.sampled_from([1, 2, 3]), donate=st.booleans(),
       max_grad_norm=st.sampled_from([None, 0.5]),
       nesting=st.sampled_from(["whole", "clip, ms", "ms, decay, lr"]))
def test_fast_equals_pure_over_drawn_trees(case: tuple[Any, Any, Any], k: int, donate: bool,
                                           max_grad_norm: float | None, nesting: str) -> None:
    # values of every kind (zeros, subnormals, huge, inf, nan: overflows) and every layout;
    # a layout the kernels refuse (a sliced leaf) takes the pure path with the warning
    params, grads, _ = case
    leaves, spec = _core.flatten(grads)

    def times(c: float) -> Any:
        return _core.unflatten(spec, [None if g is None else g * c for g in leaves])

    steps = [grads, times(4.0), grads, times(-1.0)][: k + 1]
    around, at = NESTINGS.get(nesting, (None, ()))
    rule = F.scale_by_adam() if nesting == "ms, decay, lr" else F.adamw(1e-2, weight_decay=0.1)
    _compare(F.MultiSteps(rule, every_k_schedule=k), params, steps, donate=donate,
             max_grad_norm=max_grad_norm, scale=4.0, allow_lost=True, around=around, at=at)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("donate", [False, True])
def test_compiled_inner_rule(donate: bool) -> None:
    # Lion has no PyTorch kernel: the closing mini-step takes the compiled tier (compiles)
    params = _params()
    _, closed = _compare(F.MultiSteps(F.lion(1e-2, weight_decay=0.1), every_k_schedule=2),
                         params, _scaled_grads(params, 5, 2.0**10, {2}), donate=donate,
                         max_grad_norm=0.5, scale=2.0**10, compile=True)
    assert closed == 2


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("nesting", list(NESTINGS))
def test_a_multisteps_in_the_inner_chain(nesting: str, donate: bool) -> None:
    """The prefix (a clip of each mini-step's gradients) and the suffix (a decay on
    MultiSteps' zeros, on every mini-step) as in the pure chain: bitwise on mini-steps and
    overflows, the closing chain on the kernels."""
    around, at = NESTINGS[nesting]
    rule = F.adamw(1e-2) if at == (1,) else F.scale_by_adam()
    params = _params()
    found, closed = _compare(F.MultiSteps(rule, every_k_schedule=2), params,
                             _scaled_grads(params, 6, 2.0**10, {2, 5}), donate=donate,
                             max_grad_norm=0.5, scale=2.0**10, around=around, at=at)
    assert closed == 2 and [f for f, _ in found] == [False, False, True, False, False, True]


def test_explain_says_fast_and_no_warning() -> None:
    params = _params()
    ms = F.MultiSteps(F.adamw(1e-2), every_k_schedule=2)
    masters = {n: p.float() for n, p in params.items()}
    assert F.fast.explain(ms, masters).fast
    opt = P.mixed_precision(ms.gradient_transformation())
    state = opt.init(params)
    with torch.no_grad():  # (pytest turns a FastPathWarning into an error)
        for g in _scaled_grads(params, 2, 1.0, set()):
            params, state = opt.step(g, state, params)
    assert int(state.inner_state.gradient_step) == 1


def test_an_inner_rule_without_kernel_still_warns() -> None:
    params = {"w": torch.zeros(3, dtype=torch.bfloat16)}
    opt = P.mixed_precision(F.MultiSteps(F.lion(1e-4), 2).gradient_transformation())
    with pytest.warns(F.fast.FastPathWarning, match="MultiSteps' inner transform"):
        opt.step({"w": torch.ones(3, dtype=torch.bfloat16)}, opt.init(params), params)
