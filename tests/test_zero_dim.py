"""A 0-d leaf is computed exactly like a one-element leaf of its dtype.

Transforms combine their leaves with 0-d scalars: bias corrections from the count, schedule
values, injected hyperparameters, norms. Torch's type promotion lets a 0-d float64 scalar
promote a 0-d float32 / bfloat16 / float16 leaf (but never a leaf with dimensions), so unless
each transform casts such a scalar to the dtype its leaf maths runs in, a 0-d leaf is
computed in float64 and rounds differently from the same value held in a shape-(1,) leaf.
These tests run every stateful and scaling transform and every recipe on both layouts, with
Python-number, tensor, injected and scheduled hyperparameters, and compare bitwise.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functopt
from functopt import schedules
from functopt.testing import strategies as fst
from functopt.tree import _core

F = functopt
inject = F.inject_hyperparams
LR = schedules.warmup_cosine_decay_schedule(0.0, 0.3, warmup_steps=2, decay_steps=6)


def inverse_count(count: torch.Tensor) -> torch.Tensor:
    return 1.0 / (count + 1)


def f64(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


# id -> (factory, reads params). Plain entries already meet float64 scalars (Adam's bias
# corrections, float64 schedule values); the injected and tensor entries make every
# hyperparameter a 0-d float64 tensor.
CASES: dict[str, tuple[Callable[[], Any], bool]] = {
    # scaling
    "scale[tensor]": (lambda: F.scale(f64(0.3)), False),
    "scale[injected]": (lambda: inject(F.scale)(step_size=0.3), False),
    "scale_by_schedule": (lambda: F.scale_by_schedule(LR), False),
    "scale_by_schedule[float32]": (lambda: F.scale_by_schedule(inverse_count), False),
    "scale_by_learning_rate[schedule]": (lambda: F.scale_by_learning_rate(LR), False),
    "scale_by_param_block_rms[injected]": (
        lambda: inject(F.scale_by_param_block_rms)(min_scale=0.3), True),
    "scale_by_param_block_norm[injected]": (
        lambda: inject(F.scale_by_param_block_norm)(min_scale=0.3), True),
    "scale_by_trust_ratio[injected]": (
        lambda: inject(F.scale_by_trust_ratio)(min_norm=1e-3, trust_coefficient=0.3, eps=1e-3),
        True),
    # moments
    "scale_by_adam": (lambda: F.scale_by_adam(b1=0.8, b2=0.95), False),
    "scale_by_adam[injected,nesterov,eps_root]": (
        lambda: inject(F.scale_by_adam)(b1=0.8, b2=0.95, eps=1e-3, eps_root=1e-5,
                                        nesterov=True), False),
    "scale_by_adam[bf16-mu,f32-nu]": (
        lambda: F.scale_by_adam(b1=0.8, b2=0.95, mu_dtype=torch.bfloat16,
                                nu_dtype=torch.float32), False),
    "scale_by_amsgrad": (lambda: F.scale_by_amsgrad(b1=0.8, b2=0.95), False),
    "scale_by_amsgrad[injected]": (
        lambda: inject(F.scale_by_amsgrad)(b1=0.8, b2=0.95, eps=1e-3, eps_root=1e-5), False),
    "scale_by_lion[injected]": (lambda: inject(F.scale_by_lion)(b1=0.8, b2=0.95), False),
    "scale_by_rms[injected]": (
        lambda: inject(F.scale_by_rms)(decay=0.7, eps=1e-3, initial_scale=0.1), False),
    "scale_by_rms[bias_correction,eps outside]": (
        lambda: F.scale_by_rms(decay=0.7, eps=1e-3, eps_in_sqrt=False, bias_correction=True),
        False),
    "scale_by_rms[injected,bias_correction]": (
        lambda: inject(F.scale_by_rms)(decay=0.7, eps=1e-3, eps_in_sqrt=False,
                                       bias_correction=True), False),
    "scale_by_stddev[injected]": (
        lambda: inject(F.scale_by_stddev)(decay=0.7, eps=1e-3, initial_scale=0.3), False),
    "scale_by_stddev[injected,bias_correction]": (
        lambda: inject(F.scale_by_stddev)(decay=0.7, eps=1e-3, eps_in_sqrt=False,
                                          bias_correction=True), False),
    "scale_by_rss[injected]": (
        lambda: inject(F.scale_by_rss)(initial_accumulator_value=0.1, eps=1e-3), False),
    "scale_by_sign": (lambda: F.scale_by_sign(), False),
    "scale_by_factored_rms": (lambda: F.scale_by_factored_rms(epsilon=1e-3), False),
    "scale_by_factored_rms[injected]": (
        lambda: inject(F.scale_by_factored_rms, static_args="decay_rate_fn")(
            decay_rate=0.7, epsilon=1e-3), False),
    # accumulation, adding, clipping
    "trace[injected]": (lambda: inject(F.trace)(decay=0.7), False),
    "trace[injected,nesterov]": (lambda: inject(F.trace)(decay=0.7, nesterov=True), False),
    "ema": (lambda: F.ema(decay=0.7), False),
    "ema[injected]": (lambda: inject(F.ema)(decay=0.7), False),
    "ema[injected,f32 accumulator]": (
        lambda: inject(F.ema)(decay=0.7, accumulator_dtype=torch.float32), False),
    "add_decayed_weights[tensor]": (lambda: F.add_decayed_weights(f64(0.3)), True),
    "add_decayed_weights[schedule]": (lambda: F.add_decayed_weights(LR), True),
    "clip[injected]": (lambda: inject(F.clip)(max_delta=0.3), False),
    "clip_by_block_rms[injected]": (lambda: inject(F.clip_by_block_rms)(threshold=0.3), False),
    "clip_by_global_norm[injected]": (
        lambda: inject(F.clip_by_global_norm)(max_norm=0.3), False),
    "adaptive_grad_clip[injected]": (
        lambda: inject(F.adaptive_grad_clip)(clipping=0.3, eps=1e-2), True),
    # recipes
    "sgd[schedule,momentum]": (lambda: F.sgd(LR, momentum=0.7), False),
    "sgd[injected,nesterov]": (lambda: inject(F.sgd)(0.1, momentum=0.7, nesterov=True), False),
    "adam": (lambda: F.adam(0.1), False),
    "adam[injected]": (lambda: inject(F.adam)(0.1, b1=0.8, b2=0.95), False),
    "adamw[schedule]": (lambda: F.adamw(LR, weight_decay=0.1), True),
    "adamw[injected]": (lambda: inject(F.adamw)(0.1, weight_decay=0.1), True),
    "nadam[injected]": (lambda: inject(F.nadam)(0.1), False),
    "nadamw[schedule]": (lambda: F.nadamw(LR, weight_decay=0.1), True),
    "amsgrad[injected]": (lambda: inject(F.amsgrad)(0.1), False),
    "lion[injected]": (lambda: inject(F.lion)(0.1, weight_decay=0.1), True),
    # the transforms functopt.optim needs (torch.optim's rules)
    "scale_by_adamax[injected]": (lambda: inject(F.scale_by_adamax)(b1=0.8, b2=0.95, eps=1e-3),
                                  False),
    "adamax[schedule]": (lambda: F.adamax(LR, b1=0.8, b2=0.95, eps=1e-3), False),
    "scale_by_nadam[injected]": (
        lambda: inject(F.scale_by_nadam)(b1=0.8, b2=0.95, eps=1e-3, momentum_decay=0.01),
        False),
    "scale_by_radam[injected]": (
        lambda: inject(F.scale_by_radam)(b1=0.8, b2=0.95, eps=1e-3, threshold=4.5), False),
    "radam[schedule]": (lambda: F.radam(LR, b1=0.8, b2=0.95, eps=1e-3, threshold=4.5), False),
    "scale_by_adadelta[injected]": (lambda: inject(F.scale_by_adadelta)(rho=0.7, eps=1e-3),
                                    False),
    "adadelta[schedule]": (lambda: F.adadelta(LR, rho=0.7, eps=1e-3, weight_decay=0.1), True),
    "scale_by_rprop": (lambda: F.scale_by_rprop(0.1, eta_minus=0.4, eta_plus=1.3), False),
    "rprop": (lambda: F.rprop(0.1, eta_minus=0.4, eta_plus=1.3), False),
    "dampened_trace[injected]": (
        lambda: inject(F.dampened_trace)(decay=0.7, dampening=0.2, nesterov=True), False),
    "rmsprop[injected]": (lambda: inject(F.rmsprop)(0.1, momentum=0.7), False),
    "rmsprop[injected,centered]": (
        lambda: inject(F.rmsprop)(0.1, centered=True, eps_in_sqrt=False, bias_correction=True),
        False),
    "adagrad[injected]": (lambda: inject(F.adagrad)(0.1), False),
    "lamb[schedule]": (lambda: F.lamb(LR, weight_decay=0.1), True),
    "lamb[injected]": (lambda: inject(F.lamb)(0.1, weight_decay=0.1), True),
    "lars[injected]": (lambda: inject(F.lars)(0.1, weight_decay=0.1), True),
    "adafactor[injected]": (
        lambda: inject(F.adafactor)(0.1, momentum=0.7, weight_decay_rate=0.1), True),
    "sign_sgd[schedule]": (lambda: F.sign_sgd(LR), False),
}


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.detach().reshape(-1).view(torch.uint8)


def assert_same_bits(zero_dim: Any, one_elem: Any, what: str) -> None:
    """Equal layouts except 0-d vs shape (1,) at the tested leaf; equal dtypes and bits."""
    a_leaves, a_spec = _core.flatten(zero_dim)
    b_leaves, b_spec = _core.flatten(one_elem)
    assert a_spec == b_spec, f"{what}: different structures"
    for path, a, b in zip(_core.paths(a_spec), a_leaves, b_leaves, strict=True):
        assert (a is None) == (b is None), f"{what}: {path!r}"
        if a is None:
            continue
        assert a.dtype == b.dtype, f"{what}: {path!r} has dtype {a.dtype}, expected {b.dtype}"
        assert a.numel() == b.numel(), f"{what}: {path!r} has shape {tuple(a.shape)}"
        if a.is_floating_point() and bool(torch.isnan(a).all()) and bool(torch.isnan(b).all()):
            continue  # nan payloads are not part of the contract
        assert torch.equal(_bits(a), _bits(b)), (
            f"{what}: {path!r}: {a.tolist()} (0-d leaf) != {b.tolist()} (shape-(1,) leaf)")


@st.composite
def runs(draw: st.DrawFn, dtype: torch.dtype) -> tuple[torch.Tensor | None, float, list[float]]:
    """A companion leaf (any dtype, maybe float64, for the tree-wide norms), a param value of
    ``dtype`` and the gradient values of several steps."""
    companion = draw(st.one_of(st.none(), fst.tensors(fst.dtypes(), (2,), "typical")))
    param = draw(fst.values(dtype, "typical"))
    kind = draw(st.sampled_from(["finite", "any"]))
    grads = draw(st.lists(fst.values(dtype, kind), min_size=3, max_size=5))
    return companion, param, grads


def _run(factory: Callable[[], Any], reads_params: bool, params: dict[str, Any],
         grads: list[dict[str, Any]]) -> list[tuple[Any, Any]]:
    tx = factory()
    state = tx.init(params)
    out = [(None, state)]
    for g in grads:
        updates, state = tx.update(g, state, params if reads_params else None)
        params = F.apply_updates(params, updates)
        out.append((updates, state))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("case", list(CASES))
@settings(max_examples=10)
@given(data=st.data())
def test_zero_dim_leaf_equals_one_element_leaf(case: str, dtype: torch.dtype,
                                               data: st.DataObject) -> None:
    factory, reads_params = CASES[case]
    companion, param, grad_values = data.draw(runs(dtype), label="companion, param, grads")

    def tree(value: float, shape: tuple[int, ...]) -> dict[str, Any]:
        tree_: dict[str, Any] = {"w": torch.tensor(value, dtype=dtype).reshape(shape)}
        if companion is not None:
            tree_["c"] = companion
        return tree_

    results = {shape: _run(factory, reads_params, tree(param, shape),
                           [tree(g, shape) for g in grad_values])
               for shape in [(), (1,)]}
    for step, ((u0, s0), (u1, s1)) in enumerate(zip(results[()], results[(1,)], strict=True)):
        assert_same_bits(s0, s1, f"state after {step} step(s)")
        if step:
            assert_same_bits(u0, u1, f"updates of step {step}")
            assert u0["w"].shape == () and u0["w"].dtype == dtype


def test_cases_cover_the_numeric_public_api() -> None:
    """Every public factory that does arithmetic on leaves has a case above."""
    no_arithmetic = {
        "identity", "set_to_zero", "stateless", "stateless_with_tree_map",
        "with_extra_args_support", "chain", "named_chain", "masked", "partition",
        "apply_if_finite", "inject_hyperparams", "zero_nans", "keep_params_nonnegative",
        "centralize",
        "elementwise_rule", "per_leaf_rule",  # (describe the user's own rule; no maths)
    }
    factories = {
        name for name in F.__all__
        if inspect.isfunction(getattr(F, name))
        and "GradientTransformation" in str(inspect.signature(getattr(F, name)).return_annotation)
    }
    assert {"scale", "scale_by_adam", "adamw"} <= factories  # the detector works
    covered = {case.split("[")[0] for case in CASES}
    missing = sorted(factories - covered - no_arithmetic)
    assert not missing, f"add a case to CASES in tests/test_zero_dim.py for: {missing}"
