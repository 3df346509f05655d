"""Tests of the moment-based transforms: scale_by_adam, scale_by_amsgrad, scale_by_rms,
scale_by_stddev, scale_by_rss, scale_by_lion.

Each transform is checked against an independent float64 reference written here (the
textbook update, step by step), against torch.optim where torch has the algorithm, and for
the protocol's laws (purity, dtype/shape/structure, None gradients) on hypothesis pytrees
with mixed dtypes and non-finite values.
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
from functopt.testing import strategies as fst
from functopt.tree import _core

# --------------------------------------------------------------------------- references
# Each reference runs one leaf through a list of per-step gradients (None: no gradient that
# step, the shared count still moves) in float64, and returns the updates and final state.

Ref = Callable[[dict[str, Any], tuple[int, ...], list[Any]], tuple[list[Any], dict[str, Any]]]


def _zeros(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.float64)


def _fill(shape: tuple[int, ...], value: float, h: dict[str, Any]) -> torch.Tensor:
    """An initial state value, rounded to the storage dtype (h["_storage"], if given)."""
    return torch.full(shape, value, dtype=h.get("_storage", torch.float64)).to(torch.float64)


def ref_adam(h: dict[str, Any], shape: tuple[int, ...], grads: list[Any]):
    b1, b2, eps, eps_root = h["b1"], h["b2"], h["eps"], h["eps_root"]
    m, v, out = _zeros(shape), _zeros(shape), []
    for t, g in enumerate(grads, start=1):
        if g is None:
            out.append(None)
            continue
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * (g * g)
        if h.get("nesterov", False):
            m_hat = b1 * m / (1 - b1 ** (t + 1)) + (1 - b1) * g / (1 - b1**t)
        else:
            m_hat = m / (1 - b1**t)
        v_hat = v / (1 - b2**t)
        out.append(m_hat / (torch.sqrt(v_hat + eps_root) + eps))
    return out, {"mu": m, "nu": v}


def ref_amsgrad(h: dict[str, Any], shape: tuple[int, ...], grads: list[Any]):
    b1, b2, eps, eps_root = h["b1"], h["b2"], h["eps"], h["eps_root"]
    m, v, v_max, out = _zeros(shape), _zeros(shape), _zeros(shape), []
    for t, g in enumerate(grads, start=1):
        if g is None:
            out.append(None)
            continue
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * (g * g)
        m_hat = m / (1 - b1**t) if h["bias_correction_mu"] else m
        v_hat = v / (1 - b2**t) if h["bias_correction_nu"] else v
        v_max = torch.maximum(v_max, v_hat)
        out.append(m_hat / (torch.sqrt(v_max + eps_root) + eps))
    return out, {"mu": m, "nu": v, "nu_max": v_max}


def _rms_denominator(second: torch.Tensor, h: dict[str, Any]) -> torch.Tensor:
    if h["eps_in_sqrt"]:
        return torch.sqrt(second + h["eps"])
    return torch.sqrt(second) + h["eps"]


def ref_rms(h: dict[str, Any], shape: tuple[int, ...], grads: list[Any]):
    d = h["decay"]
    v, out = _fill(shape, h["initial_scale"], h), []
    for t, g in enumerate(grads, start=1):
        if g is None:
            out.append(None)
            continue
        v = d * v + (1 - d) * (g * g)
        v_hat = v / (1 - d**t) if h["bias_correction"] else v
        out.append(g / _rms_denominator(v_hat, h))
    return out, {"nu": v}


def ref_stddev(h: dict[str, Any], shape: tuple[int, ...], grads: list[Any]):
    d = h["decay"]
    m, v = _zeros(shape), _fill(shape, h["initial_scale"], h)
    out = []
    for t, g in enumerate(grads, start=1):
        if g is None:
            out.append(None)
            continue
        m = d * m + (1 - d) * g
        v = d * v + (1 - d) * (g * g)
        c = (1 - d**t) if h["bias_correction"] else 1.0
        out.append(g / _rms_denominator(v / c - (m / c) * (m / c), h))
    return out, {"mu": m, "nu": v}


def ref_rss(h: dict[str, Any], shape: tuple[int, ...], grads: list[Any]):
    s, out = _fill(shape, h["initial_accumulator_value"], h), []
    for g in grads:
        if g is None:
            out.append(None)
            continue
        s = s + g * g
        safe = torch.where(s > 0, s + h["eps"], torch.ones_like(s))
        # a factor times g (as optax): a NaN gradient gives NaN even where s is not > 0
        out.append(torch.where(s > 0, 1 / torch.sqrt(safe), torch.zeros_like(s)) * g)
    return out, {"sum_of_squares": s}


def ref_lion(h: dict[str, Any], shape: tuple[int, ...], grads: list[Any]):
    b1, b2 = h["b1"], h["b2"]
    m, out = _zeros(shape), []
    for g in grads:
        if g is None:
            out.append(None)
            continue
        x = (1 - b1) * g + b1 * m
        # jax's sign: +-1, and +-0 / NaN kept as they are
        out.append(torch.where(x > 0, 1.0, torch.where(x < 0, -1.0, x)))
        m = b2 * m + (1 - b2) * g
    return out, {"mu": m}


# --------------------------------------------------------------------- hyperparameters

_eps = st.sampled_from([0.0, 1e-8, 1e-3, 0.5])
_open_decay = st.one_of(st.sampled_from([0.0, 0.5, 0.9, 0.999]), st.floats(0.0, 0.999))
_closed_decay = st.one_of(st.sampled_from([0.0, 0.9, 1.0]), st.floats(0.0, 1.0))

HYPERS: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    "adam": st.fixed_dictionaries({
        "b1": _open_decay, "b2": _open_decay, "eps": _eps,
        "eps_root": st.sampled_from([0.0, 1e-8]), "nesterov": st.booleans(),
    }),
    "amsgrad": st.fixed_dictionaries({
        "b1": _open_decay, "b2": _open_decay, "eps": _eps,
        "eps_root": st.sampled_from([0.0, 1e-8]),
        "bias_correction_mu": st.booleans(), "bias_correction_nu": st.booleans(),
    }),
    "rms": st.booleans().flatmap(lambda bc: st.fixed_dictionaries({
        "decay": _open_decay if bc else _closed_decay, "eps": _eps,
        "initial_scale": st.sampled_from([0.0, 0.1, 1.0]), "eps_in_sqrt": st.booleans(),
        "bias_correction": st.just(bc),
    })),
    "stddev": st.booleans().flatmap(lambda bc: st.fixed_dictionaries({
        "decay": _open_decay if bc else _closed_decay, "eps": _eps,
        "initial_scale": st.sampled_from([0.0, 0.1, 1.0]), "eps_in_sqrt": st.booleans(),
        "bias_correction": st.just(bc),
    })),
    "rss": st.fixed_dictionaries({
        "initial_accumulator_value": st.sampled_from([0.0, 0.1, 1.0]),
        "eps": st.sampled_from([0.0, 1e-7, 1e-3]),
    }),
    "lion": st.fixed_dictionaries({"b1": _closed_decay, "b2": _closed_decay}),
}

FACTORIES: dict[str, Callable[..., functopt.GradientTransformation]] = {
    "adam": functopt.scale_by_adam,
    "amsgrad": functopt.scale_by_amsgrad,
    "rms": functopt.scale_by_rms,
    "stddev": functopt.scale_by_stddev,
    "rss": functopt.scale_by_rss,
    "lion": functopt.scale_by_lion,
}

REFS: dict[str, Ref] = {
    "adam": ref_adam, "amsgrad": ref_amsgrad, "rms": ref_rms, "stddev": ref_stddev,
    "rss": ref_rss, "lion": ref_lion,
}

NAMES = sorted(FACTORIES)

# ----------------------------------------------------------------------------- helpers


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_tree_bitwise_equal(a: Any, b: Any) -> None:
    a_leaves, a_spec = _core.flatten(a)
    b_leaves, b_spec = _core.flatten(b)
    assert a_spec == b_spec
    for x, y in zip(a_leaves, b_leaves, strict=True):
        if x is None or y is None:
            assert x is None and y is None
            continue
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(_bits(x), _bits(y))


def clone_tree(tree: Any) -> Any:
    leaves, spec = _core.flatten(tree)
    return _core.unflatten(spec, [x.clone() if isinstance(x, torch.Tensor) else x
                                  for x in leaves])


def per_leaf_fields(state: Any) -> dict[str, list[Any]]:
    """The per-leaf pytree fields of a state NamedTuple, flattened."""
    return {name: _core.flatten(getattr(state, name))[0]
            for name in state._fields if name != "count"}


def run_steps(tx: functopt.GradientTransformation, params: Any, steps: list[Any]):
    state = tx.init(params)
    updates = []
    for grads in steps:
        u, state = tx.update(grads, state, params)
        updates.append(u)
    return updates, state


def close64(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-300, equal_nan=True)


# ------------------------------------------------------------------- protocol and purity


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=15)
@given(data=st.data())
def test_protocol_laws(name: str, data: st.DataObject) -> None:
    """Pure, dtype/shape/structure preserving, None grads pass and freeze their state."""
    tx = FACTORIES[name](**data.draw(HYPERS[name]))
    params = data.draw(fst.params(allow_none=True))
    steps = [data.draw(fst.gradients_like(params, kind="any", allow_none=True))
             for _ in range(2)]
    params_before = clone_tree(params)
    state = tx.init(params)
    for grads in steps:
        grads_before, state_before = clone_tree(grads), clone_tree(state)
        updates, new_state = tx.update(grads, state, params, loss=1.0, unknown_extra="x")
        assert_tree_bitwise_equal(grads, grads_before)
        assert_tree_bitwise_equal(state, state_before)
        assert_tree_bitwise_equal(params, params_before)
        assert fst.same_layout(updates, grads)
        assert type(new_state) is type(state)
        assert _core.structure(new_state) == _core.structure(state)
        g_leaves = _core.flatten(grads)[0]
        old, new = per_leaf_fields(state), per_leaf_fields(new_state)
        for field in old:
            for g, before, after in zip(g_leaves, old[field], new[field], strict=True):
                if before is None:
                    assert after is None
                    continue
                assert after.dtype == before.dtype and after.shape == before.shape
                if g is None:
                    assert torch.equal(_bits(after), _bits(before))
        if "count" in state._fields:
            assert new_state.count.dtype == torch.int32 and new_state.count.shape == ()
            assert int(new_state.count) == int(state.count) + 1
        state = new_state


# ------------------------------------------------------------------ float64 references


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=20)
@given(data=st.data())
def test_matches_float64_reference(name: str, data: st.DataObject) -> None:
    h = data.draw(HYPERS[name])
    params = data.draw(fst.params(dtypes=(torch.float64,), allow_none=True))
    steps = [data.draw(fst.gradients_like(params, kind="any", allow_none=True))
             for _ in range(3)]
    updates, state = run_steps(FACTORIES[name](**h), params, steps)

    p_leaves = _core.flatten(params)[0]
    per_step = [_core.flatten(u)[0] for u in updates]
    grads_per_step = [_core.flatten(g)[0] for g in steps]
    fields = per_leaf_fields(state)
    for i, p in enumerate(p_leaves):
        if p is None:
            continue
        expected, ref_state = REFS[name](h, tuple(p.shape), [g[i] for g in grads_per_step])
        for step, want in enumerate(expected):
            got = per_step[step][i]
            if want is None:
                assert got is None
            else:
                close64(got, want)
        for field, want in ref_state.items():
            close64(fields[field][i], want)


def _storage_round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).to(torch.float64)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=15)
@given(data=st.data())
def test_low_precision_first_step_is_the_rounded_float64_result(
    name: str, data: st.DataObject
) -> None:
    """float16/bfloat16/float32 leaves: the maths runs wide, only the result is rounded."""
    if name == "stddev":
        # nu - mu**2 cancels (by 1/decay, or fully once bias-corrected): keep it
        # well-conditioned so that float32-vs-float64 rounding stays within tolerance.
        hypers = st.fixed_dictionaries({
            "decay": st.sampled_from([0.5, 0.9]), "eps": _eps,
            "initial_scale": st.sampled_from([0.0, 0.1, 1.0]), "eps_in_sqrt": st.booleans(),
            "bias_correction": st.just(False)})
    else:
        hypers = HYPERS[name]
    h = data.draw(hypers)
    params = data.draw(fst.params(dtypes=(torch.float16, torch.bfloat16, torch.float32)))
    grads = data.draw(fst.gradients_like(params, kind="typical"))
    updates, state = run_steps(FACTORIES[name](**h), params, [grads])
    fields = per_leaf_fields(state)
    for i, (g, u) in enumerate(zip(_core.flatten(grads)[0], _core.flatten(updates)[0],
                                   strict=True)):
        assert u.dtype == g.dtype
        (want,), ref_state = REFS[name]({**h, "_storage": g.dtype}, tuple(g.shape),
                                        [g.to(torch.float64)])
        # g**2 underflows even float32 below ~1e-19 (bfloat16 reaches 1e-38): there the
        # wide maths is not float64; compare the rest.
        keep = (g.double().abs() > 1e-15) | (g == 0)
        # Likewise a second moment that float64 keeps positive but that lies below float32's
        # normal range (a decay of 1e-205 times initial_scale) may flush to zero in the wide
        # maths; with eps = 0 a zero gradient then gives 0/0 = nan where float64 gives 0,
        # the documented behaviour pinned by test_rms_zero_gradient_over_flushed_moment_*.
        second = ref_state.get("nu")
        if second is not None:
            keep &= ~((second > 0) & (second < torch.finfo(torch.float32).tiny))
        tol = 2 * torch.finfo(g.dtype).eps
        torch.testing.assert_close(u.to(torch.float64)[keep],
                                   _storage_round(want, g.dtype)[keep],
                                   rtol=tol, atol=tol, equal_nan=True)
        for field, ref in ref_state.items():
            torch.testing.assert_close(fields[field][i].to(torch.float64)[keep],
                                       _storage_round(ref, g.dtype)[keep], rtol=tol, atol=1e-30,
                                       equal_nan=True)


def test_float16_gradient_squares_do_not_overflow_the_update() -> None:
    """300**2 overflows float16; the update is computed wide, so it is still about 1."""
    g = {"w": torch.tensor([300.0, -1000.0], dtype=torch.float16)}
    params = {"w": torch.zeros(2, dtype=torch.float16)}
    for tx in (functopt.scale_by_adam(), functopt.scale_by_amsgrad(),
               functopt.scale_by_rms(bias_correction=True, eps_in_sqrt=False),
               functopt.scale_by_rss(initial_accumulator_value=0.0)):
        u, _ = tx.update(g, tx.init(params), params)
        assert u["w"].dtype == torch.float16
        assert torch.isfinite(u["w"]).all()
        torch.testing.assert_close(u["w"].float(), torch.tensor([1.0, -1.0]), rtol=2e-3, atol=0)


def test_adam_float32_second_moment_keeps_float16_training_finite() -> None:
    """With nu_dtype=float32, big float16 gradients survive several steps."""
    tx = functopt.scale_by_adam(nu_dtype=torch.float32)
    params = {"w": torch.zeros(1, dtype=torch.float16)}
    state = tx.init(params)
    assert state.nu["w"].dtype == torch.float32 and state.mu["w"].dtype == torch.float16
    for _ in range(3):
        u, state = tx.update({"w": torch.tensor([1000.0], dtype=torch.float16)}, state)
        assert u["w"].dtype == torch.float16
        torch.testing.assert_close(u["w"].float(), torch.ones(1), rtol=2e-3, atol=0)
    assert torch.isfinite(state.nu["w"]).all()


# ------------------------------------------------------------------------- scale_by_adam


@pytest.mark.parametrize("storage", [torch.bfloat16, torch.float16])
def test_adam_low_precision_storage_keeps_update_dtype(storage: torch.dtype) -> None:
    torch.manual_seed(0)
    params = {"w": torch.zeros(64)}
    grads = [{"w": torch.randn(64)} for _ in range(4)]
    low = functopt.scale_by_adam(mu_dtype=storage, nu_dtype=storage)
    full = functopt.scale_by_adam()
    (u_low, s_low), (u_full, _) = run_steps(low, params, grads), run_steps(full, params, grads)
    assert s_low.mu["w"].dtype == storage and s_low.nu["w"].dtype == storage
    for a, b in zip(u_low, u_full, strict=True):
        assert a["w"].dtype == torch.float32
        # only storage rounding differs: a few storage ulps, relative to the update scale
        torch.testing.assert_close(a["w"], b["w"], rtol=0.05, atol=0.05)


@settings(max_examples=10)
@given(b1=st.floats(0.0, 0.99), b2=st.floats(0.0, 0.999), nesterov=st.booleans())
def test_adam_tensor_hyperparameters_match_numbers(b1: float, b2: float, nesterov: bool) -> None:
    torch.manual_seed(1)
    params = {"w": torch.zeros(5, dtype=torch.float64)}
    grads = [{"w": torch.randn(5, dtype=torch.float64)} for _ in range(3)]
    as_numbers = functopt.scale_by_adam(b1, b2, nesterov=nesterov)
    as_tensors = functopt.scale_by_adam(torch.tensor(b1, dtype=torch.float64),
                                        torch.tensor(b2, dtype=torch.float64),
                                        torch.tensor(1e-8), nesterov=nesterov)
    for a, b in zip(run_steps(as_numbers, params, grads)[0],
                    run_steps(as_tensors, params, grads)[0], strict=True):
        torch.testing.assert_close(a["w"], b["w"], rtol=1e-12, atol=0)


def test_adam_differentiable_in_b1() -> None:
    """torch.func.grad through a tensor hyperparameter agrees with finite differences."""
    torch.manual_seed(2)
    grads = [torch.randn(4, dtype=torch.float64) for _ in range(3)]

    def loss(b1: torch.Tensor) -> torch.Tensor:
        tx = functopt.scale_by_adam(b1=b1)
        state = tx.init({"w": torch.zeros(4, dtype=torch.float64)})
        total = torch.zeros((), dtype=torch.float64)
        for g in grads:
            u, state = tx.update({"w": g}, state)
            total = total + (u["w"] * torch.arange(4.0, dtype=torch.float64)).sum()
        return total

    b1 = torch.tensor(0.8, dtype=torch.float64)
    analytic = torch.func.grad(loss)(b1)
    h = 1e-6
    numeric = (loss(b1 + h) - loss(b1 - h)) / (2 * h)
    torch.testing.assert_close(analytic, numeric, rtol=1e-5, atol=1e-8)


def test_adam_count_saturates_at_int32_max() -> None:
    tx = functopt.scale_by_adam()
    params = {"w": torch.zeros(1)}
    state = tx.init(params)._replace(count=torch.tensor(2**31 - 1, dtype=torch.int32))
    u, state = tx.update({"w": torch.ones(1)}, state)
    assert int(state.count) == 2**31 - 1
    assert torch.isfinite(u["w"]).all()


def test_adam_nesterov_first_step_by_hand() -> None:
    tx = functopt.scale_by_adam(b1=0.5, b2=0.5, eps=0.0, nesterov=True)
    u, _ = tx.update({"w": torch.tensor([2.0])}, tx.init({"w": torch.zeros(1)}))
    # m = 1, m_hat = 0.5 * 1 / 0.75 + 0.5 * 2 / 0.5 = 2 + 2/3; v_hat = 4
    torch.testing.assert_close(u["w"], torch.tensor([(2 + 2 / 3) / 2]))


# --------------------------------------------------------------- torch.optim golden runs


def _torch_run(opt_cls: type, kwargs: dict[str, Any], p0: torch.Tensor,
               grads: list[torch.Tensor]) -> list[torch.Tensor]:
    p = p0.clone().requires_grad_(True)
    opt = opt_cls([p], **kwargs)
    out = []
    for g in grads:
        p.grad = g.clone()
        opt.step()
        out.append(p.detach().clone())
    return out


def _functopt_run(tx: functopt.GradientTransformation, p0: torch.Tensor,
                  grads: list[torch.Tensor]) -> list[torch.Tensor]:
    params = {"p": p0.clone()}
    state = tx.init(params)
    out = []
    for g in grads:
        u, state = tx.update({"p": g}, state, params)
        params = functopt.apply_updates(params, u)
        out.append(params["p"])
    return out


def _golden(seed: int, steps: int = 8, shape: tuple[int, ...] = (3, 4)):
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(shape, generator=gen, dtype=torch.float64)
    grads = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(steps)]
    return p0, grads


def _assert_trajectories_close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)


@settings(max_examples=10)
@given(seed=st.integers(0, 2**16), lr=st.floats(1e-4, 1.0), b1=st.floats(0.0, 0.99),
       b2=st.floats(0.5, 0.999), eps=st.sampled_from([1e-8, 1e-3]))
def test_adam_matches_torch_optim(seed: int, lr: float, b1: float, b2: float, eps: float) -> None:
    p0, grads = _golden(seed)
    want = _torch_run(torch.optim.Adam, dict(lr=lr, betas=(b1, b2), eps=eps, foreach=False),
                      p0, grads)
    got = _functopt_run(functopt.chain(functopt.scale_by_adam(b1, b2, eps),
                                       functopt.scale(-lr)), p0, grads)
    _assert_trajectories_close(got, want)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_adam_orders_the_arithmetic_as_torch_at_the_top_of_the_range(amsgrad: bool) -> None:
    """A gradient at float64's maximum: nu overflows to inf at once, mu stays finite. torch
    divides mu by the denominator before the bias correction (0, not inf / inf = NaN), and
    takes sqrt(nu) / sqrt(1 - b2**t) (finite where nu / (1 - b2**t) overflows)."""
    top = torch.finfo(torch.float64).max
    grads = [torch.tensor([top, 0.0, 1e154], dtype=torch.float64)] * 3
    p0 = torch.zeros(3, dtype=torch.float64)
    want = _torch_run(torch.optim.Adam, dict(lr=1e-3, amsgrad=amsgrad, foreach=False), p0,
                      grads)
    rule = (functopt.scale_by_amsgrad(correct_after_max=True) if amsgrad
            else functopt.scale_by_adam())
    got = _functopt_run(functopt.chain(rule, functopt.scale(-1e-3)), p0, grads)
    for x, y in zip(got, want, strict=True):
        assert bool(torch.isfinite(y).all())  # the reference is finite: 0, 0, and a step
        torch.testing.assert_close(x, y, rtol=1e-12, atol=0)


@settings(max_examples=10)
@given(seed=st.integers(0, 2**16), lr=st.floats(1e-4, 1.0), b1=st.floats(0.0, 0.99),
       b2=st.floats(0.5, 0.999))
def test_amsgrad_matches_torch_while_second_moment_grows(
    seed: int, lr: float, b1: float, b2: float
) -> None:
    """With |g| non-decreasing, max over corrected nu (optax) = max over raw nu (torch)."""
    p0, base = _golden(seed)
    grads = [g * (1 + t) for t, g in enumerate(base[:1] * len(base))]
    want = _torch_run(torch.optim.Adam,
                      dict(lr=lr, betas=(b1, b2), eps=1e-8, amsgrad=True, foreach=False),
                      p0, grads)
    got = _functopt_run(functopt.chain(functopt.scale_by_amsgrad(b1, b2, 1e-8),
                                       functopt.scale(-lr)), p0, grads)
    _assert_trajectories_close(got, want)


def test_amsgrad_differs_from_torch_once_second_moment_shrinks() -> None:
    """The documented difference: optax keeps the peak of the *corrected* nu."""
    b2 = 0.9
    grads = [torch.tensor([10.0], dtype=torch.float64)] + [
        torch.tensor([0.1], dtype=torch.float64)] * 3
    tx = functopt.scale_by_amsgrad(b1=0.0, b2=b2, eps=0.0)
    state = tx.init({"p": torch.zeros(1, dtype=torch.float64)})
    for g in grads:
        u, state = tx.update({"p": g}, state)
    assert state.nu_max["p"].item() == pytest.approx(100.0)  # corrected peak: g_1**2
    assert u["p"].item() == pytest.approx(0.1 / 10.0)
    torch_p = _torch_run(torch.optim.Adam, dict(lr=1.0, betas=(0.0, b2), eps=0.0,
                                                amsgrad=True, foreach=False),
                         torch.zeros(1, dtype=torch.float64), grads)
    torch_last_update = (torch_p[-1] - torch_p[-2]).item()
    # torch: sqrt(max raw nu / (1 - b2**4)) = sqrt(10 / (1 - 0.9**4))
    assert torch_last_update == pytest.approx(-0.1 / math.sqrt(10 / (1 - b2**4)))
    assert abs(torch_last_update) != pytest.approx(abs(u["p"].item()), rel=0.1)


@pytest.mark.parametrize("centered", [False, True])
@settings(max_examples=8)
@given(seed=st.integers(0, 2**16), lr=st.floats(1e-4, 0.1), alpha=st.floats(0.1, 0.999),
       eps=st.sampled_from([1e-8, 1e-2]))
def test_rms_and_stddev_match_torch_rmsprop(
    centered: bool, seed: int, lr: float, alpha: float, eps: float
) -> None:
    # alpha near 0 makes the centered variance cancel to ~0, where torch's fused addcmul
    # rounds to a tiny negative (sqrt: NaN) and the unfused form here to 0: both are
    # rounding noise, so the comparison keeps away from it.
    p0, grads = _golden(seed)
    want = _torch_run(torch.optim.RMSprop,
                      dict(lr=lr, alpha=alpha, eps=eps, centered=centered, foreach=False),
                      p0, grads)
    factory = functopt.scale_by_stddev if centered else functopt.scale_by_rms
    tx = functopt.chain(factory(decay=alpha, eps=eps, eps_in_sqrt=False), functopt.scale(-lr))
    _assert_trajectories_close(_functopt_run(tx, p0, grads), want)


@settings(max_examples=10)
@given(seed=st.integers(0, 2**16), lr=st.floats(1e-4, 1.0),
       initial=st.sampled_from([0.01, 0.1, 1.0]))
def test_rss_matches_torch_adagrad(seed: int, lr: float, initial: float) -> None:
    p0, grads = _golden(seed)
    want = _torch_run(torch.optim.Adagrad,
                      dict(lr=lr, initial_accumulator_value=initial, eps=0.0, foreach=False),
                      p0, grads)
    tx = functopt.chain(functopt.scale_by_rss(initial, 0.0), functopt.scale(-lr))
    _assert_trajectories_close(_functopt_run(tx, p0, grads), want)


def test_rms_bias_corrected_equals_adam_without_first_moment() -> None:
    """optax's note: scale_by_rms(b2, eps outside, bias-corrected) == scale_by_adam(b1=0)."""
    p0, grads = _golden(3)
    a = _functopt_run(functopt.scale_by_rms(0.99, 1e-8, eps_in_sqrt=False,
                                            bias_correction=True), p0, grads)
    b = _functopt_run(functopt.scale_by_adam(0.0, 0.99, 1e-8), p0, grads)
    _assert_trajectories_close(a, b)


# ---------------------------------------------------------------------------- misc maths


def test_rss_gradient_is_finite_where_nothing_accumulated() -> None:
    tx = functopt.scale_by_rss(initial_accumulator_value=0.0, eps=0.0)
    state = tx.init({"w": torch.zeros(2)})

    def f(g: torch.Tensor) -> torch.Tensor:
        return tx.update({"w": g}, state)[0]["w"].sum()

    grad = torch.func.grad(f)(torch.tensor([0.0, 2.0]))
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(grad, torch.tensor([0.0, 0.0]))  # d(g/|g|)/dg = 0 for g != 0


def test_rms_zero_gradient_over_zero_moment_is_nan_with_eps_zero_as_torch() -> None:
    # eps = 0 and nothing accumulated: 0 / (sqrt(0) + 0), NaN in torch.optim.RMSprop and
    # optax alike; a non-zero gradient or a positive eps stays finite.
    g = torch.tensor([0.0, 2.0])
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.RMSprop([param], lr=1.0, alpha=0.9, eps=0.0)
    param.grad = g.clone()
    opt.step()
    for eps, eps_in_sqrt in [(0.0, False), (0.0, True), (1e-8, False)]:
        tx = functopt.scale_by_rms(decay=0.9, eps=eps, eps_in_sqrt=eps_in_sqrt)
        u = tx.update({"w": g}, tx.init({"w": torch.zeros(2)}))[0]["w"]
        assert torch.isnan(u[0]) == (eps == 0.0)
        assert torch.isfinite(u[1])
        if eps == 0.0 and not eps_in_sqrt:  # torch's form, bit for bit up to the sign
            torch.testing.assert_close(-u, param.detach(), equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("eps_in_sqrt", [False, True])
def test_rms_zero_gradient_over_flushed_moment_is_nan_with_eps_zero(
    dtype: torch.dtype, eps_in_sqrt: bool
) -> None:
    # decay * initial_scale ~ 3e-206 is positive in float64 but flushes to zero in the
    # float32 maths of a float32 or narrower leaf: the zero gradient meets a zero moment
    # and gets 0/0 = NaN (documented in scale_by_rms), not the float64 answer 0. A float64
    # leaf keeps the moment and gets 0; eps > 0 gives 0 in every dtype.
    shapes = [(), (1,)]
    for shape in shapes:
        zero = torch.zeros(shape, dtype=dtype)
        tx = functopt.scale_by_rms(decay=3.1731619241842957e-205, eps=0.0, initial_scale=0.1,
                                   eps_in_sqrt=eps_in_sqrt)
        u, state = tx.update({"w": zero}, tx.init({"w": zero}))
        assert u["w"].dtype == dtype and bool(torch.isnan(u["w"]).all())
        assert not bool(state.nu["w"].any())  # the flushed moment, stored as 0
        tx = functopt.scale_by_rms(decay=3.1731619241842957e-205, eps=1e-8, initial_scale=0.1,
                                   eps_in_sqrt=eps_in_sqrt)
        u, _ = tx.update({"w": zero}, tx.init({"w": zero}))
        assert not bool(u["w"].any()) and not bool(torch.isnan(u["w"]).any())
    zero64 = torch.zeros(1, dtype=torch.float64)
    tx = functopt.scale_by_rms(decay=3.1731619241842957e-205, eps=0.0, initial_scale=0.1,
                               eps_in_sqrt=eps_in_sqrt)
    u, state = tx.update({"w": zero64}, tx.init({"w": zero64}))
    assert u["w"].item() == 0.0 and state.nu["w"].item() > 0.0


@pytest.mark.parametrize("factory", [functopt.scale_by_rms, functopt.scale_by_stddev])
def test_initial_scale_fills_the_second_moment(factory: Callable[..., Any]) -> None:
    state = factory(initial_scale=0.25).init({"w": torch.zeros(3, dtype=torch.bfloat16)})
    assert state.nu["w"].dtype == torch.bfloat16
    assert torch.equal(state.nu["w"], torch.full((3,), 0.25, dtype=torch.bfloat16))


def test_tensor_initial_values_are_not_read_back() -> None:
    v = torch.tensor(0.5, dtype=torch.float64)
    assert torch.equal(functopt.scale_by_rss(v).init({"w": torch.zeros(2)}).sum_of_squares["w"],
                       torch.full((2,), 0.5))


def test_lion_uses_previous_momentum_then_refreshes_it() -> None:
    tx = functopt.scale_by_lion(b1=0.9, b2=0.5, mu_dtype=torch.float64)
    state = tx.init({"w": torch.zeros(1)})
    assert state.mu["w"].dtype == torch.float64
    _, state = tx.update({"w": torch.tensor([1.0])}, state)  # mu = 0.5
    u, state = tx.update({"w": torch.tensor([-4.0])}, state)
    assert u["w"].item() == 1.0  # 0.1 * -4 + 0.9 * 0.5 = 0.05 > 0
    assert state.mu["w"].item() == pytest.approx(-1.75)
    assert u["w"].dtype == torch.float32


def test_stddev_centering_by_hand() -> None:
    tx = functopt.scale_by_stddev(decay=0.5, eps=0.0, bias_correction=True)
    state = tx.init({"w": torch.zeros(1, dtype=torch.float64)})
    _, state = tx.update({"w": torch.tensor([1.0], dtype=torch.float64)}, state)
    u, _ = tx.update({"w": torch.tensor([3.0], dtype=torch.float64)}, state)
    # mu = 1.75, nu = 4.75, /0.75: mu_hat = 7/3, nu_hat = 19/3; var = 19/3 - 49/9 = 8/9
    assert u["w"].item() == pytest.approx(3.0 / math.sqrt(8 / 9))


# -------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("factory", "kwargs", "error", "match"),
    [
        (functopt.scale_by_adam, {"b1": 1.0}, ValueError, r"b1 must be in \[0, 1\), got 1.0"),
        (functopt.scale_by_adam, {"b2": -0.1}, ValueError, r"b2 must be in \[0, 1\)"),
        (functopt.scale_by_adam, {"eps": -1e-8}, ValueError, r"eps must be in \[0, inf\)"),
        (functopt.scale_by_adam, {"mu_dtype": torch.int32}, TypeError, "mu_dtype must be None"),
        (functopt.scale_by_amsgrad, {"b2": 1.0}, ValueError, r"scale_by_amsgrad: b2 must be"),
        (functopt.scale_by_amsgrad, {"eps_root": -1.0}, ValueError, "eps_root must be in"),
        (functopt.scale_by_amsgrad, {"nu_dtype": "bf16"}, TypeError, "nu_dtype must be None"),
        (functopt.scale_by_rms, {"decay": 1.5}, ValueError, r"decay must be in \[0, 1\], got"),
        (functopt.scale_by_rms, {"decay": 1.0, "bias_correction": True}, ValueError,
         r"decay must be in \[0, 1\)"),
        (functopt.scale_by_rms, {"initial_scale": -1.0}, ValueError, "initial_scale must be"),
        (functopt.scale_by_rms, {"eps": "small"}, TypeError, "eps must be a number"),
        (functopt.scale_by_stddev, {"decay": -0.5}, ValueError, "scale_by_stddev: decay must"),
        (functopt.scale_by_stddev, {"eps": float("nan")}, ValueError, "eps must be in"),
        (functopt.scale_by_rss, {"initial_accumulator_value": -0.1}, ValueError,
         "initial_accumulator_value must be in"),
        (functopt.scale_by_rss, {"eps": -1.0}, ValueError, "scale_by_rss: eps must be in"),
        (functopt.scale_by_lion, {"b1": 1.1}, ValueError, r"b1 must be in \[0, 1\]"),
        (functopt.scale_by_lion, {"b2": torch.ones(2)}, TypeError, "0-d tensor"),
        (functopt.scale_by_lion, {"mu_dtype": torch.bool}, TypeError, "mu_dtype must be None"),
    ],
)
def test_bad_hyperparameters(factory: Callable[..., Any], kwargs: dict[str, Any],
                             error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        factory(**kwargs)


@pytest.mark.parametrize("name", NAMES)
def test_gradient_for_a_param_that_was_none_at_init(name: str) -> None:
    tx = FACTORIES[name]()
    state = tx.init({"a": torch.zeros(1), "b": None})
    match = r"'b' has a gradient but state\.\w+ holds None"
    with pytest.raises(ValueError, match=match):
        tx.update({"a": torch.ones(1), "b": torch.ones(1)}, state)


@pytest.mark.parametrize("name", NAMES)
def test_state_of_another_tree_is_rejected(name: str) -> None:
    tx = FACTORIES[name]()
    state = tx.init({"a": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"state\.\w+ does not have the structure of updates"):
        tx.update({"b": torch.ones(1)}, state)


@pytest.mark.parametrize("name", NAMES)
def test_state_of_another_shape_is_rejected(name: str) -> None:
    """A stale state would otherwise broadcast against the gradient without a word."""
    tx = FACTORIES[name]()
    state = tx.init({"a": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"'a': state\.\w+ has shape \(3,\) but the gradient "
                                         r"has shape \(1,\)"):
        tx.update({"a": torch.ones(1)}, state)


@pytest.mark.parametrize("name", NAMES)
def test_integer_gradient_is_rejected(name: str) -> None:
    tx = FACTORIES[name]()
    state = tx.init({"a": torch.zeros(1)})
    with pytest.raises(TypeError, match=r"'a' is a int64 tensor .* expected a floating-point"):
        tx.update({"a": torch.ones(1, dtype=torch.int64)}, state)
