"""``mixed_precision(..., fused=True)`` (the kernel path of functopt/precision/_fused.py)
against ``fused=False`` (the pure path).

Each run: 5 steps of bfloat16/float16 params (plus a float32 leaf), gradients scaled by the
loss scale, an inf in one leaf at step 2 (that step is skipped) and a ``None`` gradient at
step 3. The kernel path folds unscale and clip into one division and orders Adam's
arithmetic differently, so masters and inner state agree to rounding: with float64 masters
to a relative 1e-12, with float32 masters to a few float32 ulps. The decisions (overflow,
loss scale, skipped steps, zero counts) are exact and agree bitwise, and so does the norm
(see ``test_metrics_agree``).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

import functopt
from functopt.fast import FastPathWarning
from functopt.precision import (
    NormClip,
    dynamic_loss_scale,
    float32_master,
    kahan_summation,
    mixed_precision,
    stochastic_rounding,
)
from functopt.testing import assert_bitwise_equal
from functopt.testing._compare import tensor_difference
from functopt.tree import _core

STEPS = 5
INF_STEP, NONE_STEP = 2, 3
REL_FLOAT64 = 1e-12
# float32 masters, whole 5-step trajectories (rounding differences compound), per leaf in
# units of eps(float32) times the leaf's largest value. Measured over 20 seeds of every
# float32-master configuration below (inner x param dtype x loss scale x clipping): at most
# 5.2. Rounded up plus margin: 8 ulps; a wrong clip factor, a skipped unscale or a lost
# bias correction is off by orders of magnitude more.
ULPS_FLOAT32 = 8.0


def _schedule() -> functopt.Schedule:
    return functopt.schedules.cosine_decay_schedule(0.05, decay_steps=8, alpha=0.1)


INNERS: dict[str, Callable[[], functopt.GradientTransformation]] = {
    "adamw": lambda: functopt.adamw(1e-2, weight_decay=0.1),
    "adam": lambda: functopt.adam(1e-2),
    "adam_schedule": lambda: functopt.adam(_schedule()),
    "sgd_momentum": lambda: functopt.sgd(0.1, momentum=0.9),
    # hyperparameters read from the state at every step
    "injected_adamw": lambda: functopt.inject_hyperparams(functopt.adamw)(
        learning_rate=1e-2, weight_decay=0.1),
    # composed chains, lowered by the planner: the inner clip's norm is packed beside the
    # step's statistics (one reduction), after the step's own clip when there is one
    "clip_adamw": lambda: functopt.chain(functopt.clip_by_global_norm(0.05),
                                         functopt.adamw(1e-2, weight_decay=0.1)),
    "masked_adamw": lambda: functopt.adamw(1e-2, weight_decay=0.1,
                                           mask={"a": True, "b": False, "f": True}),
    # apply_if_finite inside the mixed step sees finite gradients on every step taken
    "guarded_adamw": lambda: functopt.apply_if_finite(functopt.adamw(1e-2, weight_decay=0.1),
                                                      2),
    "partition": lambda: functopt.partition(
        {"x": functopt.adamw(1e-2, weight_decay=0.1), "y": functopt.sgd(0.1, momentum=0.9)},
        {"a": "x", "b": "y", "f": "x"}),
}


def _clone(tree: Any) -> Any:
    leaves, spec = _core.flatten(tree)
    return _core.unflatten(spec, [x.clone() if isinstance(x, torch.Tensor) else x
                                  for x in leaves])


def _pairs(actual: Any, expected: Any) -> list[tuple[str, Any, Any]]:
    a_leaves, a_spec = _core.flatten(actual)
    e_leaves, e_spec = _core.flatten(expected)
    assert a_spec == e_spec, f"structures differ: {a_spec} vs {e_spec}"
    return list(zip(_core.paths(e_spec), a_leaves, e_leaves, strict=True))


def _assert_bitwise(actual: Any, expected: Any, what: str = "") -> None:
    assert_bitwise_equal(actual, expected, what=what or "trees")


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    if b.numel() == 0:
        return 0.0
    diff = (a.double() - b.double()).abs().max().item()
    scale = b.double().abs().max().item()
    return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


def _assert_close(actual: Any, expected: Any, what: str) -> None:
    """Floating leaves within REL_FLOAT64 (float64) or ULPS_FLOAT32 (float32); the rest
    bitwise (counters)."""
    for path, a, e in _pairs(actual, expected):
        if not isinstance(e, torch.Tensor):
            assert a == e, f"{what} {path}"
            continue
        assert a.dtype == e.dtype and a.shape == e.shape, (what, path, a.dtype, e.dtype)
        if not e.is_floating_point():
            assert torch.equal(a, e), f"{what} {path}: {a} vs {e}"
            continue
        bound = {torch.float64: REL_FLOAT64,
                 torch.float32: ULPS_FLOAT32 * torch.finfo(torch.float32).eps}[e.dtype]
        assert _relative(a, e) <= bound, (
            f"{what} {path}: relative difference {_relative(a, e):.3g} > {bound:.3g}")


def _params(seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(7, 5, generator=gen).to(dtype),  # several SIMD blocks + remainder
        "b": torch.randn(20, generator=gen).to(dtype),
        "f": torch.randn(3, generator=gen),  # float32: no master under float32_master()
    }


def _grads(seed: int, step: int, params: dict[str, torch.Tensor], scale: torch.Tensor,
           grad_dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Gradients times the loss scale (exact: a power of two), in each param's dtype (or
    ``grad_dtype``), with a few exact zeros; an inf at INF_STEP, None at NONE_STEP."""
    gen = torch.Generator().manual_seed(500 + 17 * seed + step)
    out: dict[str, Any] = {}
    for k, p in params.items():
        g = torch.randn(p.shape, generator=gen)
        g[..., 0] = 0.0
        out[k] = (g.to(p.dtype).to(torch.float32) * scale.float()).to(grad_dtype or p.dtype)
    if step == INF_STEP:
        out["b"][3] = float("inf")
    if step == NONE_STEP:
        out["a"] = None
    return out


def _opts(inner: str, master_dtype: torch.dtype, loss_scale: float | None,
          clip: float | NormClip | None, **kwargs: Any) -> tuple[Any, Any]:
    common = dict(
        loss_scale=None if loss_scale is None else dynamic_loss_scale(init_scale=loss_scale),
        master_weights=float32_master(master_dtype), max_grad_norm=clip, **kwargs)
    return (mixed_precision(INNERS[inner](), fused=True, **common),
            mixed_precision(INNERS[inner](), fused=False, **common))


CONFIGS = list(itertools.product(
    list(INNERS), [torch.float64, torch.float32], [torch.bfloat16, torch.float16],
    [None, 2.0 ** 10], [None, 1.0]))
# LightRFT's clip rule (the norm plus 1e-6), under both loss-scale settings
CONFIGS += [(inner, torch.float32, torch.bfloat16, ls, NormClip(1.0, eps=1e-6))
            for inner in INNERS for ls in (None, 2.0 ** 10)]


def _id(config: tuple[Any, ...]) -> str:
    inner, mdt, pdt, ls, clip = config
    return (f"{inner}-master_{str(mdt)[6:]}-{str(pdt)[6:]}-"
            f"{'noscale' if ls is None else 'dynamic'}-"
            f"{'noclip' if clip is None else 'clip' if isinstance(clip, float) else 'clip_eps'}")


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Records, for every mixed step, whether the fused path ran (True) or declined."""
    from functopt.precision import step as step_module

    calls: list[bool] = []
    real = step_module.fused_mixed_step

    def spy(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        calls.append(not isinstance(out, str))  # a str: the planner's reason to decline
        return out

    monkeypatch.setattr(step_module, "fused_mixed_step", spy)
    return calls


@pytest.mark.parametrize("config", CONFIGS, ids=[_id(c) for c in CONFIGS])
def test_fused_equals_pure(config: tuple[Any, ...], fused_calls: list[bool]) -> None:
    inner, master_dtype, param_dtype, loss_scale, clip = config
    fused, pure = _opts(inner, master_dtype, loss_scale, clip)
    params = _params(0, param_dtype)
    f_params, f_state = _clone(params), fused.init(params)
    p_params, p_state = _clone(params), pure.init(params)
    scales = []
    for i in range(STEPS):
        grads = _grads(0, i, params, p_state.loss_scale.scale)
        before = _clone((f_params, f_state.master, f_state.inner_state))
        f_params, f_state = fused.step(_clone(grads), f_state, f_params)
        p_params, p_state = pure.step(_clone(grads), p_state, p_params)
        what = f"step {i}"
        # the decisions: bitwise
        assert bool(f_state.metrics.found_inf) == (i == INF_STEP), what
        _assert_bitwise(f_state.loss_scale, p_state.loss_scale, what)
        _assert_bitwise(f_state.metrics, p_state.metrics, what)
        _assert_bitwise(f_state.key, p_state.key, what)
        scales.append(float(f_state.loss_scale.scale))
        # masters and inner state: to rounding
        _assert_close(f_state.master, p_state.master, what)
        _assert_close(f_state.inner_state, p_state.inner_state, what)
        # params are the rounded masters; a param without master is compared itself
        for k, p in f_params.items():
            m = f_state.master[k]
            if m is None:
                _assert_close(p, p_params[k], what)
            else:
                assert torch.equal(p, m.to(p.dtype)), f"{what} {k}: param is not its master"
        if i == INF_STEP:  # skipped: bitwise as before
            _assert_bitwise((f_params, f_state.master, f_state.inner_state), before, what)
        if i == NONE_STEP:  # no gradient: that leaf's param and master stay as they were
            _assert_bitwise((f_params["a"], f_state.master["a"]),
                            (before[0]["a"], before[1]["a"]), what)
    if loss_scale is not None:
        assert scales[INF_STEP] == loss_scale / 2 and scales[0] == loss_scale
    assert int(f_state.metrics.skipped_steps) == 1
    # every fused step really ran the kernel (the pure one never asks it)
    assert fused_calls == [True] * STEPS
    # the run moved the masters (the comparison is not vacuous)
    assert _relative(f_state.master["a"] if f_state.master["a"] is not None
                     else f_params["a"], params["a"].to(master_dtype)) > 1e-3


def test_metrics_agree() -> None:
    """``grad_norm`` is bitwise equal on both paths (float32), not just within an ulp: with
    a power-of-two loss scale, multiplying a leaf's norm by 1/scale is exact, so the norm
    of the scaled gradients times 1/scale is the norm of the unscaled ones (the module
    docstring of _fused.py), and both paths sum the same per-leaf squares in float64. The
    zero counts are exact counts; with count_zeros=False both report -1."""
    params = _params(1, torch.float16)
    for count_zeros in (True, False):
        fused, pure = _opts("adamw", torch.float32, 2.0 ** 10, 1.0, count_zeros=count_zeros)
        f_state, p_state = fused.init(params), pure.init(params)
        f_params, p_params = _clone(params), _clone(params)
        norms = []
        for i in range(STEPS):
            grads = _grads(1, i, params, p_state.loss_scale.scale)
            f_params, f_state = fused.step(grads, f_state, f_params)
            p_params, p_state = pure.step(grads, p_state, p_params)
            fm, pm = f_state.metrics, p_state.metrics
            assert fm.grad_norm.dtype == torch.float32
            assert tensor_difference(fm.grad_norm, pm.grad_norm) is None, (i, fm, pm)
            norms.append(float(fm.grad_norm))
            if count_zeros:
                # 7 + 20 + 3 leaf rows' first elements are zero (the "a" rows: 7)
                zeros = (0 if grads["a"] is None else 7) + 1 + 1
                assert int(fm.num_zeros) == int(pm.num_zeros) == zeros, (i, fm, pm)
            else:
                assert int(fm.num_zeros) == int(pm.num_zeros) == -1
        assert all(n > 1.0 for n in norms if n == n and n != float("inf")), norms


@pytest.mark.parametrize("master_dtype", [torch.float32, torch.float64],
                         ids=["master_float32", "master_float64"])
@pytest.mark.parametrize("grad_dtype", ["param", "master"])
def test_donate_updates_in_place(master_dtype: torch.dtype, grad_dtype: str) -> None:
    """donate=True: the returned params, masters and moments are the passed tensors,
    updated in place (nn.Parameter leaves that require grad included); the gradients,
    which the docstring says are never written, stay bitwise as passed; and the values
    agree with the pure path."""
    fused, pure = _opts("adamw", master_dtype, 2.0 ** 10, 1.0, donate=True)
    model = torch.nn.Linear(6, 4).to(torch.bfloat16)
    params = dict(model.named_parameters())
    state = fused.init({k: p.detach() for k, p in params.items()})
    p_params = {k: p.detach().clone() for k, p in params.items()}
    p_state = pure.init(p_params)
    for i in range(3):
        gen = torch.Generator().manual_seed(i)
        dtype = master_dtype if grad_dtype == "master" else torch.bfloat16
        grads = {k: (torch.randn(p.shape, generator=gen) * 1024).to(dtype)
                 for k, p in params.items()}
        grads_before = _clone(grads)
        masters = dict(state.master)
        moments = [x for x in _core.flatten(state.inner_state)[0] if x.dim()]
        with torch.no_grad():  # in grad mode, params that require grad take the pure path
            new, state = fused.step(grads, state, params)
        p_params, p_state = pure.step(grads, p_state, p_params)
        assert all(new[k] is params[k] for k in params), "params must be written in place"
        assert all(state.master[k] is masters[k] for k in params), "masters copied"
        new_moments = [x for x in _core.flatten(state.inner_state)[0] if x.dim()]
        assert all(a is b for a, b in zip(new_moments, moments, strict=True)), "moments copied"
        _assert_bitwise(grads, grads_before, f"step {i} grads")
        _assert_close(state.master, p_state.master, f"step {i}")
        assert all(torch.equal(p.detach(), state.master[k].to(p.dtype)) for k, p in new.items())
    assert params["weight"] is model.weight and model.weight.requires_grad


def test_grad_mode_with_params_that_require_grad_is_pure() -> None:
    """Outside no_grad, params that require grad keep the step differentiable: the fused
    option takes the pure path, bitwise (and writes nothing in place, donate or not)."""
    fused, pure = _opts("adamw", torch.float32, 2.0 ** 10, 1.0, donate=True)
    params = {k: torch.nn.Parameter(v) for k, v in _params(5, torch.bfloat16).items()}
    state = fused.init({k: p.detach() for k, p in params.items()})
    grads = _grads(5, 0, params, state.loss_scale.scale)
    got, got_state = fused.step(grads, _clone(state), params)
    want, want_state = pure.step(grads, state, params)
    _assert_bitwise((got, got_state), (want, want_state))
    assert all(got[k] is not params[k] for k in params)


@pytest.mark.parametrize("inner", list(INNERS))
def test_no_donation_leaves_inputs_unchanged(inner: str) -> None:
    fused, _ = _opts(inner, torch.float32, 2.0 ** 10, 1.0)
    params = _params(2, torch.bfloat16)
    state = fused.init(params)
    for i in range(STEPS):
        for grad_dtype in (None, torch.float32):  # autograd's dtype, or float32 main grads
            grads = _grads(2, i, params, state.loss_scale.scale, grad_dtype)
            before = _clone((grads, state, params))
            new_params, new_state = fused.step(grads, state, params)
            _assert_bitwise((grads, state, params), before, f"step {i} inputs")
        params, state = new_params, new_state


@pytest.mark.parametrize("case", ["kahan", "stochastic_rounding", "lion"])
@pytest.mark.parametrize("donate", [False, True], ids=["copy", "donate"])
def test_no_kernel_takes_the_pure_path_bitwise(case: str, donate: bool) -> None:
    inner = functopt.lion(1e-3) if case == "lion" else functopt.adamw(1e-2, weight_decay=0.1)
    master = {"kahan": kahan_summation(), "stochastic_rounding": stochastic_rounding(),
              "lion": float32_master()}[case]
    common = dict(loss_scale=dynamic_loss_scale(init_scale=2.0 ** 10), master_weights=master,
                  max_grad_norm=1.0, donate=donate)
    fused = mixed_precision(inner, fused=True, **common)
    pure = mixed_precision(inner, fused=False, **common)
    params = _params(3, torch.bfloat16)
    f_params, f_state = _clone(params), fused.init(params)
    p_params, p_state = _clone(params), pure.init(params)
    for i in range(STEPS):
        grads = _grads(3, i, params, p_state.loss_scale.scale)
        if case == "lion":  # a rule without a kernel: the step says it lost the fast path
            with pytest.warns(FastPathWarning, match="scale_by_lion has no fused kernel"):
                f_params, f_state = fused.step(_clone(grads), f_state, f_params)
        else:  # masters that are not plain copies have no fused path at all
            f_params, f_state = fused.step(_clone(grads), f_state, f_params)
        p_params, p_state = pure.step(grads, p_state, p_params)
        _assert_bitwise((f_params, f_state), (p_params, p_state), f"step {i}")
    assert int(f_state.metrics.skipped_steps) == 1


def test_two_threads_share_a_donating_step_function() -> None:
    """The donating step reuses its gradient casts between steps; two threads stepping
    their own states through one step function must not share them (each result equals
    its own pure run)."""
    common = dict(loss_scale=dynamic_loss_scale(init_scale=2.0 ** 10), max_grad_norm=1.0)
    fused = mixed_precision(functopt.adamw(1e-2), fused=True, donate=True, **common)
    pure = mixed_precision(functopt.adamw(1e-2), fused=False, **common)
    out: dict[int, Any] = {}

    def train(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        params = {"w": torch.randn(257, 31, generator=gen).to(torch.bfloat16)}
        f_params, f_state = _clone(params), fused.init(params)
        p_params, p_state = _clone(params), pure.init(params)
        for _ in range(15):
            g = {"w": (torch.randn(257, 31, generator=gen) * 2.0 ** 10).to(torch.bfloat16)}
            with torch.no_grad():
                f_params, f_state = fused.step(_clone(g), f_state, f_params)
            p_params, p_state = pure.step(g, p_state, p_params)
        out[seed] = (f_state.master, p_state.master)

    threads = [threading.Thread(target=train, args=(seed,)) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(out) == [1, 2]
    for got, want in out.values():
        _assert_close(got, want, "thread")
