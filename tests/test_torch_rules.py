"""The transforms added for torch.optim's rules, each against an independent float64
reference written here from the papers' / torch.optim's documented formulas:
dampened_trace, scale_by_adamax, scale_by_radam, scale_by_nadam, scale_by_adadelta,
scale_by_rprop, and the torch variants scale_by_amsgrad(correct_after_max=True) and
scale_by_rss(eps_in_sqrt=False). The protocol's laws for them run in tests/test_conformance.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functopt

F64 = torch.float64
values = st.floats(-5.0, 5.0, allow_nan=False, width=64)
gradient_runs = st.lists(st.lists(values, min_size=3, max_size=3), min_size=1, max_size=8)


def run(tx: functopt.GradientTransformation, grads: list[list[float]]) -> list[torch.Tensor]:
    params = {"w": torch.zeros(3, dtype=F64)}
    state = tx.init(params)
    out = []
    for g in grads:
        updates, state = tx.update({"w": torch.tensor(g, dtype=F64)}, state, params)
        out.append(updates["w"])
    return out


def close(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-300, equal_nan=True)


def ref_dampened(grads: list[torch.Tensor], mu: float, tau: float, nesterov: bool) -> list[Any]:
    buf, out = None, []
    for g in grads:
        buf = g.clone() if buf is None else mu * buf + (1 - tau) * g
        out.append(g + mu * buf if nesterov else buf)
    return out


@settings(deadline=None)
@given(grads=gradient_runs, mu=st.floats(0.0, 0.99), tau=st.floats(0.0, 1.0),
       nesterov=st.booleans())
def test_dampened_trace(grads: list[list[float]], mu: float, tau: float, nesterov: bool) -> None:
    tx = functopt.dampened_trace(mu, dampening=tau, nesterov=nesterov)
    close(run(tx, grads), ref_dampened([torch.tensor(g, dtype=F64) for g in grads], mu, tau,
                                       nesterov))


@settings(deadline=None)
@given(grads=gradient_runs, mu=st.floats(0.0, 0.99), nesterov=st.booleans())
def test_dampened_trace_without_dampening_is_trace_bitwise(
        grads: list[list[float]], mu: float, nesterov: bool) -> None:
    got = run(functopt.dampened_trace(mu, nesterov=nesterov), grads)
    expected = run(functopt.trace(mu, nesterov=nesterov), grads)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


@settings(deadline=None)
@given(grads=gradient_runs, b1=st.floats(0.0, 0.99), b2=st.floats(0.0, 1.0),
       eps=st.floats(1e-8, 1e-2))
def test_scale_by_adamax(grads: list[list[float]], b1: float, b2: float, eps: float) -> None:
    m = u = torch.zeros(3, dtype=F64)
    expected = []
    for t, g in enumerate((torch.tensor(g, dtype=F64) for g in grads), start=1):
        m = b1 * m + (1 - b1) * g
        u = torch.maximum(b2 * u, g.abs() + eps)
        expected.append(m / (1 - b1**t) / u)
    close(run(functopt.scale_by_adamax(b1, b2, eps), grads), expected)


@settings(deadline=None)
@given(grads=gradient_runs, b2=st.sampled_from([0.5, 0.8, 0.9, 0.99]),
       eps=st.floats(1e-8, 1e-1), torch_eps=st.booleans())
def test_scale_by_radam(grads: list[list[float]], b2: float, eps: float,
                        torch_eps: bool) -> None:
    b1 = 0.9
    m = v = torch.zeros(3, dtype=F64)
    rho_inf = 2 / (1 - b2) - 1
    expected = []
    for t, g in enumerate((torch.tensor(g, dtype=F64) for g in grads), start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat = m / (1 - b1**t)
        rho = rho_inf - 2 * t * b2**t / (1 - b2**t)
        if rho >= 5:
            r = math.sqrt((rho - 4) * (rho - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho))
            denom = ((v.sqrt() + eps) / math.sqrt(1 - b2**t) if torch_eps
                     else (v / (1 - b2**t)).sqrt() + eps)
            expected.append(r * m_hat / denom)
        else:
            expected.append(m_hat)
    close(run(functopt.scale_by_radam(b1, b2, eps, eps_before_correction=torch_eps), grads),
          expected)


@settings(deadline=None)
@given(grads=gradient_runs, psi=st.floats(0.0, 0.5), eps=st.floats(1e-8, 1e-2))
def test_scale_by_nadam(grads: list[list[float]], psi: float, eps: float) -> None:
    b1, b2 = 0.9, 0.99
    m = v = torch.zeros(3, dtype=F64)
    product, expected = 1.0, []
    for t, g in enumerate((torch.tensor(g, dtype=F64) for g in grads), start=1):
        mu, mu_next = (b1 * (1 - 0.5 * 0.96 ** (s * psi)) for s in (t, t + 1))
        product *= mu
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        denom = (v / (1 - b2**t)).sqrt() + eps
        expected.append(((1 - mu) / (1 - product) * g
                         + mu_next / (1 - product * mu_next) * m) / denom)
    close(run(functopt.scale_by_nadam(b1, b2, eps, momentum_decay=psi), grads), expected)


@settings(deadline=None)
@given(grads=gradient_runs, rho=st.floats(0.0, 1.0), eps=st.floats(1e-8, 1e-2))
def test_scale_by_adadelta(grads: list[list[float]], rho: float, eps: float) -> None:
    e_g = e_x = torch.zeros(3, dtype=F64)
    expected = []
    for g in (torch.tensor(g, dtype=F64) for g in grads):
        e_g = rho * e_g + (1 - rho) * g * g
        delta = (e_x + eps).sqrt() / (e_g + eps).sqrt() * g
        e_x = rho * e_x + (1 - rho) * delta * delta
        expected.append(delta)
    close(run(functopt.scale_by_adadelta(rho, eps), grads), expected)


@settings(deadline=None)
@given(grads=gradient_runs, lr=st.floats(1e-3, 1.0), eta_minus=st.floats(0.1, 0.9),
       eta_plus=st.floats(1.1, 2.0))
def test_scale_by_rprop(grads: list[list[float]], lr: float, eta_minus: float,
                        eta_plus: float) -> None:
    lo, hi = 1e-3, 2.0
    size = torch.full((3,), lr, dtype=F64)
    prev = torch.zeros(3, dtype=F64)
    expected = []
    for g in (torch.tensor(g, dtype=F64) for g in grads):
        out, new_prev = torch.zeros(3, dtype=F64), g.clone()
        for i in range(3):
            s = g[i] * prev[i]
            factor = eta_plus if s > 0 else eta_minus if s < 0 else 1.0
            size[i] = min(max(size[i] * factor, lo), hi)
            if s < 0:
                new_prev[i] = 0.0
            out[i] = torch.sign(new_prev[i]) * size[i]
        prev = new_prev
        expected.append(out)
    tx = functopt.scale_by_rprop(lr, eta_minus, eta_plus, min_step_size=lo, max_step_size=hi)
    close(run(tx, grads), expected)


@settings(deadline=None)
@given(grads=gradient_runs, eps=st.floats(1e-10, 1e-2))
def test_amsgrad_correct_after_max(grads: list[list[float]], eps: float) -> None:
    b1, b2 = 0.9, 0.99
    m = v = v_max = torch.zeros(3, dtype=F64)
    expected = []
    for t, g in enumerate((torch.tensor(g, dtype=F64) for g in grads), start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        v_max = torch.maximum(v_max, v)
        expected.append(m / (1 - b1**t) / (v_max.sqrt() / math.sqrt(1 - b2**t) + eps))
    close(run(functopt.scale_by_amsgrad(b1, b2, eps, correct_after_max=True), grads), expected)


def test_amsgrad_correct_after_max_needs_the_correction() -> None:
    with pytest.raises(ValueError, match=r"correct_after_max=True.*bias_correction_nu=False"):
        functopt.scale_by_amsgrad(bias_correction_nu=False, correct_after_max=True)


@settings(deadline=None)
@given(grads=gradient_runs, s0=st.floats(0.0, 1.0), eps=st.floats(1e-10, 1e-2))
def test_scale_by_rss_eps_outside(grads: list[list[float]], s0: float, eps: float) -> None:
    s = torch.full((3,), s0, dtype=F64)
    expected = []
    for g in (torch.tensor(g, dtype=F64) for g in grads):
        s = s + g * g
        expected.append(torch.where(s > 0, g / (s.sqrt() + eps), 0.0))
    close(run(functopt.scale_by_rss(s0, eps, eps_in_sqrt=False), grads), expected)


@pytest.mark.parametrize(("factory", "match"), [
    (lambda: functopt.dampened_trace(0.9, dampening=1.5), "dampening"),
    (lambda: functopt.scale_by_adamax(b1=1.0), "b1"),
    (lambda: functopt.scale_by_radam(threshold=3.0), "threshold"),
    (lambda: functopt.scale_by_nadam(momentum_decay=-1.0), "momentum_decay"),
    (lambda: functopt.scale_by_adadelta(rho=1.5), "rho"),
    (lambda: functopt.scale_by_rprop(0.1, eta_minus=1.5), "eta_minus"),
    (lambda: functopt.scale_by_rprop(0.0), "learning_rate"),
])
def test_bad_hyperparameters(factory: Callable[[], Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        factory()
