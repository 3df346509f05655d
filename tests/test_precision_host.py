"""The fused mixed step's scalar bookkeeping on the host (functopt/precision/_host.py).

On the CPU the fused step reads its statistics once and computes the loss scale, the clip
factor, the multiplier and the metrics in Python. These tests hold that arithmetic to the
tensors': the loss-scale rule against its own tensor form and against PyTorch's
``torch._amp_update_scale_`` (the kernel ``GradScaler.update`` runs), the float32 rounding
against torch's cast, and whole fused steps against the same steps with the host path
switched off, bitwise in every param and state leaf (dtypes included).
"""

from __future__ import annotations

import math
import struct

import optree
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import functopt
from functopt.precision import _fused, _host
from functopt.precision.loss_scale import has_host_rule, host_adjust


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (nan payloads and signed zeros included)."""
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@given(st.floats(allow_nan=False, width=64))
def test_f32_rounds_as_torch_casts(x: float) -> None:
    expected = torch.tensor(x, dtype=torch.float64).to(torch.float32).item()
    assert _bits(_host.f32(x)) == _bits(expected)


@given(st.integers(-(2**63), 2**63 - 1), st.integers(-3, 3))
def test_wrap_is_torch_integer_arithmetic(n: int, k: int) -> None:
    # int64 -> int32 keeps the low 32 bits, as int32 arithmetic wraps; int64 + k wraps too
    assert _host.wrap(n, 32) == torch.tensor(n, dtype=torch.int64).to(torch.int32).item()
    assert _host.wrap(n + k, 64) == (torch.tensor(n, dtype=torch.int64) + k).item()


_SCALES = st.one_of(
    st.integers(-140, 127).map(lambda e: 2.0**e),  # powers of two, subnormal to the top
    st.floats(1e-44, 3.4e38, allow_nan=False, allow_infinity=False),
    st.sampled_from([3.4028234663852886e38, 1.401298464324817e-45, 1.0]))


@given(
    overflows=st.lists(st.booleans(), max_size=14),
    init_scale=_SCALES,
    growth=st.sampled_from([2.0, 1.5, 3.0, 1.0000001, 10.0]),
    backoff=st.sampled_from([0.5, 0.25, 0.3, 0.999, 1e-3]),
    interval=st.integers(1, 4),
    hysteresis=st.integers(1, 3),
    bounds=st.tuples(st.none() | st.sampled_from([1e-30, 0.3, 1.0, 7.0]),
                     st.none() | st.sampled_from([2.0**24, 1e10, 3.3e38])),
)
def test_host_rule_is_the_tensor_rule(overflows, init_scale, growth, backoff, interval,
                                      hysteresis, bounds) -> None:
    lo, hi = bounds
    init_scale = min(max(init_scale, lo or 0.0), hi or math.inf)
    if lo is not None and hi is not None and lo > hi:
        lo = None
    ls = functopt.dynamic_loss_scale(init_scale=init_scale, growth_factor=growth,
                                     backoff_factor=backoff, growth_interval=interval,
                                     hysteresis=hysteresis, min_scale=lo, max_scale=hi)
    assert has_host_rule(ls)
    tensor = host = ls.init()
    for i, overflow in enumerate(overflows):
        tensor = ls.adjust(tensor, torch.tensor(overflow))
        host = host_adjust(ls, host, overflow, reuse=i % 2 == 0)
        for a, b in zip(host, tensor, strict=True):
            assert _same_tensor(a, b), (i, host, tensor)


@given(
    overflows=st.lists(st.booleans(), max_size=14),
    init_exp=st.integers(-30, 127),
    growth=st.sampled_from([2.0, 4.0, 1.5]),
    backoff=st.sampled_from([0.5, 0.125, 0.3]),
    interval=st.integers(1, 4),
)
def test_host_rule_is_amp_update_scale(overflows, init_exp, growth, backoff, interval) -> None:
    # PyTorch's own kernel, the reference for hysteresis=1 with no bounds
    ls = functopt.dynamic_loss_scale(2.0**init_exp, growth_factor=growth,
                                     backoff_factor=backoff, growth_interval=interval)
    state = ls.init()
    scale = torch.tensor(2.0**init_exp, dtype=torch.float32)
    tracker = torch.zeros((), dtype=torch.int32)
    for overflow in overflows:
        torch._amp_update_scale_(scale, tracker, torch.tensor(float(overflow)), growth,
                                 backoff, interval)
        state = host_adjust(ls, state, overflow, reuse=True)
        assert _same_tensor(state.scale, scale) and _same_tensor(state.growth_tracker, tracker)


def test_static_and_hand_built_rules() -> None:
    static = functopt.static_loss_scale(8.0)
    state = static.init()
    assert host_adjust(static, state, True, reuse=False) is state  # as its adjust returns
    by_hand = functopt.LossScale(static.init, lambda s, f: s, dynamic=False)
    assert not has_host_rule(by_hand)  # only its own adjust can run it
    huge = functopt.dynamic_loss_scale(growth_interval=2**40)
    assert not has_host_rule(huge)  # int32 arithmetic beyond int32: left to torch


_CASES = {
    "dynamic, clip": dict(inner=lambda: functopt.adamw(1e-3, weight_decay=1e-2),
                          loss_scale=functopt.dynamic_loss_scale(2.0**10, growth_interval=2),
                          max_grad_norm=1.0, count_zeros=False),
    "hysteresis, bounds, inner clip, zeros": dict(
        inner=lambda: functopt.chain(functopt.clip_by_global_norm(0.5), functopt.adamw(1e-3)),
        loss_scale=functopt.dynamic_loss_scale(3.0, growth_factor=1.7, backoff_factor=0.3,
                                               growth_interval=2, hysteresis=2,
                                               min_scale=1.1, max_scale=40.0),
        max_grad_norm=torch.tensor(0.3), count_zeros=True),
    "no scale, scheduled lr, sgd": dict(
        inner=lambda: functopt.inject_hyperparams(functopt.sgd)(
            learning_rate=functopt.schedules.linear_schedule(1e-2, 1e-3, 6), momentum=0.9),
        loss_scale=None, max_grad_norm=None, count_zeros=True),
}


def _trajectory(case: dict, donate: bool) -> list[list[torch.Tensor]]:
    opt = functopt.precision.mixed_precision(
        case["inner"](), loss_scale=case["loss_scale"], max_grad_norm=case["max_grad_norm"],
        count_zeros=case["count_zeros"], donate=donate)
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 3, generator=gen).bfloat16(),
              "b": torch.randn(5, generator=gen).bfloat16(),
              "f": torch.randn(2, generator=gen)}  # a float32 param: its own master
    state = opt.init(params)
    seen = []
    for k in range(7):
        grads = {n: (torch.randn(p.shape, generator=gen) * 300).to(p.dtype)
                 for n, p in params.items()}
        if k in (2, 5):
            grads["b"][1] = math.inf if k == 2 else math.nan  # skipped steps
        if k == 4:
            grads["f"] = None
        with torch.no_grad():
            params, state = opt.step(grads, state, params)
        seen.append([t.clone() for t in optree.tree_leaves((params, state))
                     if isinstance(t, torch.Tensor)])
    return seen


@pytest.mark.parametrize("donate", [True, False])
@pytest.mark.parametrize("case", list(_CASES))
def test_fused_step_on_the_host_is_the_tensor_step(case, donate, monkeypatch) -> None:
    calls = []
    real = _fused._host_kernel_step
    monkeypatch.setattr(_fused, "_host_kernel_step",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    host = _trajectory(_CASES[case], donate)
    assert len(calls) == 7  # every step took the host path
    monkeypatch.setattr(_host, "on_host", lambda *tensors: False)
    tensor = _trajectory(_CASES[case], donate)
    assert len(calls) == 7
    for k, (a, b) in enumerate(zip(host, tensor, strict=True)):
        assert len(a) == len(b)
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert _same_tensor(x, y), (k, i, x, y)


def test_on_host_takes_plain_cpu_tensors_only() -> None:
    cpu = torch.zeros(())
    assert _host.on_host(cpu, torch.ones(3))
    assert _host.on_host()  # (nothing to read)
    assert not _host.on_host(cpu, torch.zeros((), device="meta"))
    assert not _host.on_host(torch.nn.Parameter(torch.zeros(())))  # a subclass
