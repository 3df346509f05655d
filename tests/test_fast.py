"""``functopt.fast``: ``make_step`` on the planner's fused kernels against the pure path.

The pure path (``tx.update`` then ``functopt.apply_updates``) is the reference. A fused
kernel orders the arithmetic differently (``torch._fused_adamw_`` folds the bias
corrections into one step size; the half-precision kernels compute in float32 and round
once), so in float64 it must agree to a relative 1e-12 and in the narrower dtypes to a
few ulps of each leaf's largest value. Every path that is not a kernel (no fused form,
leaves the kernel refuses) adds the same updates with grouped ``foreach`` adds, so it is
bitwise the pure path.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import functopt
from functopt.fast import FastPathWarning, _staged, explain, make_step
from functopt.fast._step import differentiated
from functopt.testing import assert_bitwise_equal
from functopt.testing import strategies as fst
from functopt.tree import _core

STEPS = 5
REL_FLOAT64 = 1e-12

# Per-step agreement in the narrow dtypes, per leaf (params and every state tensor), in
# units of eps(dtype) times the leaf's largest magnitude before or after the step (see
# _ulps: a moment whose terms nearly cancel is rounded at the size of its terms).
# Measured with these helpers (PyTorch 2.13, CPU): one step from the same inputs, 30 seeds
# x 5 steps of every recipe below, on 35-, 4-element and 0-d leaves (both sides of the
# kernels' SIMD width): at most 1.52 in float32, 0.96 in bfloat16 and 1.00 in float16 (the
# half kernels compute in float32 and round once; the pure chain rounds each stage). The
# bounds are those maxima rounded up, plus one ulp: a real error (a missing bias
# correction, decay applied twice, the wrong lr) moves a leaf by far more.
ULPS = {torch.float32: 3.0, torch.bfloat16: 2.0, torch.float16: 2.0}


def _schedule() -> functopt.Schedule:
    return functopt.schedules.cosine_decay_schedule(0.05, decay_steps=8, alpha=0.1)


# Every recipe whose options have a fused form; name -> factory (a fresh transform per test,
# since a 0-d tensor lr is a tensor the test must not share).
FUSED_RECIPES: dict[str, Callable[[], functopt.GradientTransformation]] = {
    "adam": lambda: functopt.adam(1e-2),
    "adamw": lambda: functopt.adamw(1e-2, weight_decay=0.1),
    "sgd": lambda: functopt.sgd(0.1),
    "sgd_momentum": lambda: functopt.sgd(0.1, momentum=0.9),
    "sgd_nesterov": lambda: functopt.sgd(0.1, momentum=0.9, nesterov=True),
    "adam_schedule": lambda: functopt.adam(_schedule()),
    "adamw_schedule": lambda: functopt.adamw(_schedule(), weight_decay=0.1),
    "adam_tensor_lr": lambda: functopt.adam(torch.tensor(1e-2, dtype=torch.float64)),
    "adamw_tensor_lr": lambda: functopt.adamw(torch.tensor(1e-2, dtype=torch.float64),
                                              weight_decay=0.1),
    # inject_hyperparams keeps the recipe's kernel, rebuilt from the state every step
    "injected_adamw": lambda: functopt.inject_hyperparams(functopt.adamw)(
        learning_rate=1e-2, weight_decay=0.1),
    "injected_sgd_momentum": lambda: functopt.inject_hyperparams(functopt.sgd)(
        learning_rate=0.1, momentum=0.9),
    "injected_adam_schedule": lambda: functopt.inject_hyperparams(functopt.adam)(
        learning_rate=_schedule()),
    # composed chains: the planner lowers them as they are written
    "adamw_mask": lambda: functopt.adamw(1e-2, weight_decay=0.1,
                                         mask=lambda p: {k: k != "b" for k in p}),
    "clip_adamw": lambda: functopt.chain(functopt.clip_by_global_norm(0.5),
                                         functopt.adamw(1e-2, weight_decay=0.1)),
    "adam_decay_schedule": lambda: functopt.chain(
        functopt.scale_by_adam(), functopt.add_decayed_weights(0.01),
        functopt.scale_by_learning_rate(_schedule())),
    "named_clip_adam": lambda: functopt.named_chain(
        ("clip", functopt.clip_by_global_norm(1.0)), ("opt", functopt.adam(1e-2))),
    "partition_adamw_sgd": lambda: functopt.partition(
        {"a": functopt.adamw(1e-2, weight_decay=0.1),
         "s": functopt.sgd(0.1, momentum=0.9)}, {"w": "a", "b": "s", "s": "a"}),
    "masked_clip_sgd": lambda: functopt.chain(
        functopt.masked(functopt.clip_by_global_norm(0.1), {"w": True, "b": False,
                                                             "s": False}),
        functopt.sgd(0.1, momentum=0.9)),
    "injected_masked_adamw": lambda: functopt.inject_hyperparams(
        functopt.adamw, static_args="mask")(learning_rate=_schedule(), weight_decay=0.1,
                                            mask={"w": True, "b": False, "s": True}),
    "sgd_schedule": lambda: functopt.sgd(_schedule(), momentum=0.9),
    "sgd_decay": lambda: functopt.chain(functopt.add_decayed_weights(0.1),
                                        functopt.sgd(0.1, momentum=0.9)),
    # torch.optim's maximize (a leading scale(-1)) and Adam's L2 weight_decay (decay before
    # the moments): the kernels' maximize flag and torch._fused_adam_'s weight_decay
    "adamw_maximize": lambda: functopt.chain(functopt.scale(-1.0),
                                             functopt.adamw(1e-2, weight_decay=0.1)),
    "adam_l2": lambda: functopt.chain(functopt.add_decayed_weights(0.1), functopt.adam(1e-2)),
    "sgd_maximize_l2": lambda: functopt.chain(functopt.scale(-1.0),
                                              functopt.add_decayed_weights(0.1),
                                              functopt.sgd(0.1, momentum=0.9)),
    # torch's AMSGrad (max of the raw second moments): the kernels' amsgrad=True
    "amsgrad_torch": lambda: functopt.chain(
        functopt.scale_by_amsgrad(correct_after_max=True), functopt.add_decayed_weights(0.1),
        functopt.scale_by_learning_rate(1e-2)),
    "frozen_partition": lambda: functopt.partition(
        {"a": functopt.adamw(1e-2), "f": functopt.set_to_zero()},
        {"w": "a", "b": "f", "s": "a"}),
}

_SGD = ("sgd", "sgd_momentum", "sgd_nesterov", "injected_sgd_momentum", "sgd_schedule",
        "sgd_decay", "masked_clip_sgd", "partition_adamw_sgd", "sgd_maximize_l2")

# Chains that take the grouped foreach apply (no kernel, or leaves the kernel refuses).
FALLBACKS: dict[str, Callable[[], functopt.GradientTransformation]] = {
    "lion": lambda: functopt.lion(1e-3, weight_decay=0.1),
    "nadam": lambda: functopt.nadam(1e-2),
    "adamw_mu_bf16": lambda: functopt.adamw(1e-2, mu_dtype=torch.bfloat16),
    "sgd_accumulator_bf16": lambda: functopt.sgd(0.1, momentum=0.9,
                                                 accumulator_dtype=torch.bfloat16),
    # a zero momentum keeps a trace that torch._fused_sgd_ would not write
    "sgd_zero_momentum": lambda: functopt.sgd(0.1, momentum=0.0),
    "injected_lion": lambda: functopt.inject_hyperparams(functopt.lion)(learning_rate=1e-3),
    "clip_after_adam": lambda: functopt.chain(functopt.scale_by_adam(),
                                              functopt.clip_by_global_norm(1.0),
                                              functopt.scale(-1e-2)),
    "opaque": lambda: functopt.chain(
        functopt.GradientTransformation(lambda p: (), lambda u, s, p=None: (u, s)),
        functopt.sgd(0.1)),
}


# ----------------------------------------------------------------------------- helpers

def _params(seed: int, dtype: torch.dtype = torch.float64) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)

    # 35 elements: several SIMD blocks plus a remainder; 4, 0-d and empty: remainders only
    return {"w": r(7, 5), "b": r(4), "s": [r(), r(0)]}


def _grads(seed: int, params: dict[str, Any], step: int) -> dict[str, Any]:
    """Gradients that depend on the params (as in training), with ``None`` for ``b`` on odd
    steps and for the empty leaf on every step."""
    g = _params(1000 + seed * 31 + step, params["w"].dtype)
    g = {"w": g["w"] + 0.5 * params["w"], "b": g["b"], "s": [g["s"][0], None]}
    if step % 2:
        g["b"] = None
    return g


def _clone(tree: Any) -> Any:
    leaves, spec = _core.flatten(tree)
    return _core.unflatten(spec, [x.clone() if isinstance(x, torch.Tensor) else x
                                  for x in leaves])


def _pure_step(tx: functopt.GradientTransformation, grads: Any, state: Any, params: Any,
               ) -> tuple[Any, Any]:
    updates, state = tx.update(grads, state, params)
    return functopt.apply_updates(params, updates), state


def _pairs(actual: Any, expected: Any) -> list[tuple[str, Any, Any]]:
    """Leaves of two trees of the same structure, with their paths (structure asserted)."""
    a_leaves, a_spec = _core.flatten(actual)
    e_leaves, e_spec = _core.flatten(expected)
    assert a_spec == e_spec, f"structures differ: {a_spec} vs {e_spec}"
    return list(zip(_core.paths(e_spec), a_leaves, e_leaves, strict=True))


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 when both are empty; exact equality needed when b is 0)."""
    if b.numel() == 0:
        return 0.0
    diff = (a.double() - b.double()).abs().max().item()
    scale = b.double().abs().max().item()
    return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)


def _assert_close_trees(actual: Any, expected: Any, *, rel: float | None = None,
                        ulps: float | None = None, before: Any = None, what: str = "") -> None:
    """Leaf by leaf: same dtype and shape; floating leaves within ``rel`` (relative to the
    leaf's largest value) or ``ulps`` (eps(dtype) times the largest value of the leaf, or
    of the same leaf in ``before``, whichever is larger); other leaves bitwise."""
    before_leaves = (None if before is None
                     else [x for _, x, _ in _pairs(before, expected)])
    for j, (path, a, e) in enumerate(_pairs(actual, expected)):
        if not isinstance(e, torch.Tensor):
            assert a == e, f"{what} {path}: {a!r} vs {e!r}"
            continue
        assert isinstance(a, torch.Tensor), f"{what} {path}: {a!r}"
        assert a.dtype == e.dtype and a.shape == e.shape, (what, path, a.dtype, e.dtype)
        if not e.is_floating_point():
            assert torch.equal(a, e), f"{what} {path}: {a} vs {e}"
            continue
        if ulps is None:
            assert rel is not None
            assert _relative(a, e) <= rel, (
                f"{what} {path}: relative difference {_relative(a, e):.3g} > {rel:.3g}")
            continue
        assert _ulps(a, e, None if before_leaves is None else before_leaves[j]) <= ulps, (
            f"{what} {path}: {_ulps(a, e, before_leaves and before_leaves[j]):.3g} ulps")


def _ulps(a: torch.Tensor, e: torch.Tensor, before: torch.Tensor | None) -> float:
    """max |a - e| in units of eps(dtype) times the leaf's largest magnitude, after the step
    (``e``) or before it (``before``): a moment that nearly cancels (``b1 * mu + (1 - b1) *
    g`` close to 0) is rounded at the size of its terms, not of its result."""
    if e.numel() == 0:
        return 0.0
    scale = e.double().abs().max().item()
    if before is not None:
        scale = max(scale, before.double().abs().max().item())
    diff = (a.double() - e.double()).abs().max().item()
    if scale == 0:
        return 0.0 if diff == 0 else math.inf
    return diff / (scale * torch.finfo(e.dtype).eps)


def _assert_bitwise(actual: Any, expected: Any, what: str = "") -> None:
    assert_bitwise_equal(actual, expected, what=what or "trees")


def _layout(tree: Any) -> tuple[Any, list[Any]]:
    leaves, spec = _core.flatten(tree)
    return spec, [(x.dtype, tuple(x.shape)) if isinstance(x, torch.Tensor) else x
                  for x in leaves]


def _kernel_takes(tx: Any, grads: Any, state: Any, params: Any) -> bool:
    """Whether make_step takes the planner's kernels (and not the differentiable path)."""
    return explain(tx, params, state, grads).fast and not differentiated(params, grads, state)


# ---------------------------------------------------------------------- float64: 1e-12

@pytest.mark.parametrize("donate", [False, True], ids=["copy", "donate"])
@pytest.mark.parametrize("recipe", list(FUSED_RECIPES))
def test_float64_trajectory_equals_pure(recipe: str, donate: bool) -> None:
    tx = FUSED_RECIPES[recipe]()
    step = make_step(tx, donate=donate)
    params = _params(0)
    ref_params, ref_state = _clone(params), tx.init(params)
    state = tx.init(params)
    init_layout = _layout(state)
    for i in range(STEPS):
        grads = _grads(0, ref_params, i)
        assert _kernel_takes(tx, grads, state, params), "the kernel should take these leaves"
        params, state = step(_clone(grads), state, params)
        ref_params, ref_state = _pure_step(tx, grads, ref_state, ref_params)
        assert _layout(state) == init_layout  # the chain's treedef, dtypes and shapes
        _assert_close_trees(params, ref_params, rel=REL_FLOAT64, what=f"step {i} params")
        _assert_close_trees(state, ref_state, rel=REL_FLOAT64, what=f"step {i} state")
    # the state is the chain's: the pure update takes it back and agrees
    grads = _grads(0, ref_params, STEPS)
    handed_back = _pure_step(tx, grads, state, params)
    _assert_close_trees(handed_back, _pure_step(tx, grads, ref_state, ref_params),
                        rel=REL_FLOAT64, what="handed back")


def test_float64_moves_the_params() -> None:
    """The comparison above is not vacuous: a step moves every param with a gradient by far
    more than the tolerance, and leaves the ones without gradient bitwise alone."""
    tx = functopt.adamw(1e-2, weight_decay=0.1)
    params = _params(0)
    grads = _grads(0, params, 1)  # "b" has no gradient on odd steps
    new, _ = make_step(tx)(grads, tx.init(params), params)
    assert _relative(new["w"], params["w"]) > 1e-4
    assert torch.equal(new["b"], params["b"])


# ------------------------------------------------------------- narrow dtypes: few ulps

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("recipe", list(FUSED_RECIPES))
def test_narrow_dtypes_per_step_within_ulps(recipe: str, dtype: torch.dtype) -> None:
    """Each step from the same params and state (the pure trajectory's), so the bound is
    one step's rounding rather than rounding compounded over a trajectory."""
    tx = FUSED_RECIPES[recipe]()
    step = make_step(tx)
    params = _params(3, dtype)
    state = tx.init(params)
    for i in range(STEPS):
        grads = _grads(3, params, i)
        # torch._fused_sgd_ is avoided for half dtypes on the CPU: a step with SGD leaves
        # that have gradients takes the pure path (and says so); every other step fuses
        half_sgd = recipe in _SGD and dtype in (torch.bfloat16, torch.float16) and (
            not _kernel_takes(tx, grads, state, params))
        assert half_sgd or _kernel_takes(tx, grads, state, params)
        if half_sgd:
            with pytest.warns(FastPathWarning, match="pytorch/pytorch#191763"):
                got = step(grads, _clone(state), _clone(params))
        else:
            got = step(grads, _clone(state), _clone(params))
        before = (params, state)
        params, state = _pure_step(tx, grads, state, params)
        if half_sgd:
            # torch._fused_sgd_ is wrong for these on the CPU (see the test below): the
            # step must take the pure path, bitwise
            _assert_bitwise(got, (params, state), what=f"step {i}")
        else:
            _assert_close_trees(got, (params, state), ulps=ULPS[dtype], before=before,
                                what=f"step {i}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("momentum", [None, 0.9])
def test_sgd_half_on_cpu_matches_pure(dtype: torch.dtype, momentum: float | None) -> None:
    """torch._fused_sgd_ on the CPU leaves every full SIMD block of a float16/bfloat16
    param unchanged and writes wrong momentum buffers (pytorch/pytorch#191763, PyTorch 2.12
    and 2.13); make_step must not hand these leaves to it."""
    tx = functopt.sgd(0.5, momentum=momentum)
    params = {"w": torch.ones(64, dtype=dtype)}
    grads = {"w": torch.ones(64, dtype=dtype)}
    state = tx.init(params)
    with pytest.warns(FastPathWarning, match="pytorch/pytorch#191763"):
        got, got_state = make_step(tx)(grads, state, params)
    want, want_state = _pure_step(tx, grads, state, params)
    assert torch.equal(want["w"], torch.full((64,), 0.5, dtype=dtype))
    _assert_bitwise((got, got_state), (want, want_state))


# ------------------------------------------------------------------------- donation

@pytest.mark.parametrize("recipe", ["adamw", "sgd_momentum", "adam_schedule"])
def test_donate_updates_in_place(recipe: str) -> None:
    tx = FUSED_RECIPES[recipe]()
    model = torch.nn.Linear(5, 3).double()
    params = dict(model.named_parameters())
    assert all(p.requires_grad for p in params.values())
    state = tx.init({k: p.detach() for k, p in params.items()})
    ref_params = {k: p.detach().clone() for k, p in params.items()}
    ref_state = _clone(state)
    moments = [x for x in _core.flatten(state)[0] if isinstance(x, torch.Tensor) and x.dim()]
    step = make_step(tx, donate=True)
    for i in range(3):
        grads = {k: torch.randn_like(p) for k, p in ref_params.items()}
        with torch.no_grad():  # in grad mode, params that require grad take the pure path
            assert _kernel_takes(tx, grads, state, params)
            new, state = step(grads, state, params)
        ref_params, ref_state = _pure_step(tx, grads, ref_state, ref_params)
        assert all(new[k] is params[k] for k in params), "params must be updated in place"
        assert all(isinstance(p, torch.nn.Parameter) and p.requires_grad for p in new.values())
        new_moments = [x for x in _core.flatten(state)[0]
                       if isinstance(x, torch.Tensor) and x.dim()]
        assert len(new_moments) == len(moments)
        assert all(a is b for a, b in zip(new_moments, moments, strict=True)), "moments copied"
        _assert_close_trees({k: p.detach() for k, p in new.items()}, ref_params,
                            rel=REL_FLOAT64, what=f"step {i}")
    assert dict(model.named_parameters())["weight"] is params["weight"]


@pytest.mark.parametrize("donate", [False, True], ids=["copy", "donate"])
def test_grad_mode_with_params_that_require_grad_is_pure(donate: bool) -> None:
    """Outside no_grad, a step on params that require grad stays differentiable: it takes
    the pure path (bitwise), writes into nothing even when donated, and keeps the graph."""
    tx = functopt.adamw(1e-2, weight_decay=0.1)
    params = {k: torch.nn.Parameter(v) for k, v in _params(4).items() if k != "s"}
    plain = {k: p.detach().clone() for k, p in params.items()}
    state = tx.init(plain)
    grads = {k: torch.randn_like(p) for k, p in plain.items()}
    want, want_state = _pure_step(tx, grads, state, plain)
    got, got_state = make_step(tx, donate=donate)(grads, _clone(state), params)
    _assert_bitwise(({k: p.detach() for k, p in got.items()}, got_state), (want, want_state))
    assert all(got[k] is not params[k] and got[k].grad_fn is not None for k in params)
    _assert_bitwise({k: p.detach() for k, p in params.items()}, plain)  # not written


@pytest.mark.parametrize("recipe", list(FUSED_RECIPES) + list(FALLBACKS))
def test_no_donation_leaves_inputs_bitwise_unchanged(recipe: str) -> None:
    factories = {**FUSED_RECIPES, **FALLBACKS}
    tx = factories[recipe]()
    step = make_step(tx)
    params = _params(5, torch.float32)
    state = tx.init(params)
    for i in range(3):
        grads = _grads(5, params, i)
        before = _clone((grads, state, params))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FastPathWarning)  # the fallbacks say so
            new_params, new_state = step(grads, state, params)
        _assert_bitwise((grads, state, params), before, what=f"step {i} inputs")
        params, state = new_params, new_state


# ---------------------------------------------- gradients a clip's kernel must not write

# A clip folded into a kernel's grad_scale: the kernels unscale their gradients in place,
# so the gradients a caller keeps (no donate_grads) reach them as copies, staged on the CPU
# batch by batch through one scratch buffer of _staged.BUDGET_BYTES (set to 64 elements
# here, so that a step has several batches and cuts its larger leaves into pieces).
CLIPPED: dict[str, Callable[[], functopt.GradientTransformation]] = {
    "adamw": lambda: functopt.chain(functopt.clip_by_global_norm(0.5),
                                    functopt.adamw(1e-2, weight_decay=0.1)),
    "amsgrad": lambda: functopt.chain(functopt.clip_by_global_norm(0.5),
                                      functopt.scale_by_amsgrad(correct_after_max=True),
                                      functopt.scale_by_learning_rate(1e-2)),
    "sgd_momentum": lambda: functopt.chain(functopt.clip_by_global_norm(0.5),
                                           functopt.sgd(0.1, momentum=0.9)),
}
_STAGED_ELEMENTS = 64


def _staged_params(dtype: torch.dtype, layouts: str) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(3)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)

    # 360 elements (cut into pieces), six leaves of 11 (several to a batch), a 0-d leaf
    params: dict[str, Any] = {"big": r(40, 9), "small": [r(11) for _ in range(6)], "s": r()}
    if layouts == "odd":
        params["t"] = r(7, 5).t()  # transposed: a copy laid out as its value
        params["cl"] = r(2, 3, 4, 5).to(memory_format=torch.channels_last)  # and cut
    return params


def _staged_grads(params: dict[str, Any], step: int) -> dict[str, Any]:
    # (elementwise of the params: each gradient laid out as its value)
    return functopt.tree.map(lambda p: p * (3.0 + step) - 0.25, params)


@pytest.fixture
def small_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_staged, "BUDGET_BYTES", _STAGED_ELEMENTS * 4)


@pytest.mark.parametrize("layouts", ["plain", "odd"])
@pytest.mark.parametrize("donate", [False, True], ids=["copy", "donate"])
@pytest.mark.parametrize(("recipe", "dtype"), [
    *((r, torch.float32) for r in CLIPPED), ("adamw", torch.bfloat16),
    ("amsgrad", torch.float16)])  # (torch._fused_sgd_ is refused in half on the CPU)
@pytest.mark.usefixtures("small_stage")
def test_kept_gradients_of_a_clip_kernel_are_never_written(
        recipe: str, donate: bool, dtype: torch.dtype, layouts: str) -> None:
    """The step that keeps the caller's gradients is bitwise the step handed them (the
    same kernels on the same values), and leaves them bitwise as they were."""
    tx = CLIPPED[recipe]()
    params = _staged_params(dtype, layouts)
    kept, handed = make_step(tx, donate=donate), make_step(tx, donate=donate, donate_grads=True)
    ours, theirs = (params, tx.init(params)), _clone((params, tx.init(params)))
    for i in range(4):
        grads = _staged_grads(ours[0], i)
        before = _clone(grads)
        with torch.no_grad():
            ours = kept(grads, ours[1], ours[0])
            theirs = handed(_clone(grads), theirs[1], theirs[0])
        _assert_bitwise(grads, before, what=f"step {i} gradients")
        _assert_bitwise(ours, theirs, what=f"step {i}")


class _Ops(TorchDispatchMode):
    """Records the operations that run: their names, and the largest tensor one returned
    that is not a view of its inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.largest, self.names = 0, set[str]()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.names.add(func.overloadpacket.__name__)
        if all(r.alias_info is None for r in func._schema.returns):
            for t in out if isinstance(out, (list, tuple)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.usefixtures("small_stage")
def test_kept_gradients_of_a_clip_kernel_take_no_copy_larger_than_the_scratch() -> None:
    """A donated step allocates no tensor beyond the scratch buffer's size: no copy of a
    whole gradient (every leaf here is larger than the buffer)."""
    tx = CLIPPED["adamw"]()
    params = {"a": torch.randn(40, 9), "b": torch.randn(300)}
    state, step = tx.init(params), make_step(tx, donate=True)
    with torch.no_grad():
        params, state = step(_staged_grads(params, 0), state, params)  # plans, allocates
        grads = _staged_grads(params, 1)
        with _Ops() as seen:
            step(grads, state, params)
    assert 0 < seen.largest <= _STAGED_ELEMENTS


@pytest.mark.parametrize("recipe", list(CLIPPED))
def test_a_clip_that_does_not_act_copies_no_gradient(recipe: str) -> None:
    """A norm within the clip's bound (a factor of exactly 1, read on the host for free on
    the CPU): the kernel reads the caller's gradients uncopied and leaves them as they
    were; the step is bitwise the step handed the gradients."""
    tx = CLIPPED[recipe]()
    params = {"a": torch.randn(40, 9), "b": torch.randn(300)}
    kept, handed = make_step(tx, donate=True), make_step(tx, donate=True, donate_grads=True)
    ours, theirs = (params, tx.init(params)), _clone((params, tx.init(params)))
    for i in range(3):
        grads = functopt.tree.map(lambda p: p * 1e-3, ours[0])  # norm well below 0.5
        before = _clone(grads)
        with torch.no_grad(), _Ops() as seen:
            ours = kept(grads, ours[1], ours[0])
        with torch.no_grad():
            theirs = handed(_clone(grads), theirs[1], theirs[0])
        assert not seen.names & {"clone", "copy_", "_foreach_copy_", "_foreach_mul_"}, (
            i, seen.names)
        _assert_bitwise(grads, before, what=f"step {i} gradients")
        _assert_bitwise(ours, theirs, what=f"step {i}")


# ---------------------------------------------------------------- fallback: bitwise

def _moments_of_another_dtype() -> tuple[functopt.GradientTransformation, Any, Any]:
    """adamw's state built on float32 params, stepped with float64 params: the pure chain
    keeps float32 moments; the kernel cannot mix dtypes in one call."""
    tx = functopt.adamw(1e-2, weight_decay=0.1)
    params = _params(7, torch.float64)
    state = tx.init(functopt.tree.cast(params, torch.float32))
    return tx, params, state


@pytest.mark.parametrize("donate", [False, True], ids=["copy", "donate"])
@pytest.mark.parametrize("case", [*FALLBACKS, "moments_of_another_dtype"])
def test_fallback_is_bitwise_pure(case: str, donate: bool) -> None:
    if case == "moments_of_another_dtype":
        tx, params, state = _moments_of_another_dtype()
        assert not _kernel_takes(tx, _grads(7, params, 0), state, params)
    else:
        tx = FALLBACKS[case]()
        params = _params(7, torch.float32)
        state = tx.init(params)
        assert not _kernel_takes(tx, _grads(7, params, 0), state, params)
    step = make_step(tx, donate=donate)
    ref_params, ref_state = _clone(params), _clone(state)
    for i in range(STEPS):
        grads = _grads(7, ref_params, i)
        passed = params
        with pytest.warns(FastPathWarning, match="make_step: the fast path is lost"):
            params, state = step(_clone(grads), state, params)
        ref_params, ref_state = _pure_step(tx, grads, ref_state, ref_params)
        _assert_bitwise((params, state), (ref_params, ref_state), what=f"step {i}")
        if donate:
            assert params["w"] is passed["w"], "a donated fallback adds in place"


# ------------------------------------------------------------------------ explain

def test_explain_names_the_groups_and_the_reason() -> None:
    params = {"w": torch.zeros(3, 2), "b": torch.zeros(2), "n": torch.zeros(2)}
    tx = functopt.chain(functopt.clip_by_global_norm(1.0), functopt.adamw(
        1e-3, weight_decay=0.1, mask={"w": True, "b": False, "n": False}))
    got = explain(tx, params)
    assert got.fast and got.reason is None and got.clips == 1
    by_decay = {g.weight_decay: g for g in got.groups}
    assert by_decay[True].leaves == ("w",) and by_decay[False].leaves == ("b", "n")
    assert all(g.kernel == "torch._fused_adamw_" and g.clip for g in got.groups)
    assert "2 kernel call(s)" in str(got)
    lost = explain(functopt.chain(functopt.scale_by_adam(), functopt.clip_by_global_norm(1.0),
                                  functopt.scale(-1e-3)), params)
    assert not lost.fast and lost.groups == ()
    assert "clip_by_global_norm after scale_by_adam" in str(lost.reason)
    with pytest.raises(TypeError, match="explain: tx must be"):
        explain(functopt.adamw, params)  # type: ignore[arg-type]


@pytest.mark.parametrize("make", [
    lambda: functopt.adam(1e-3, nesterov=True),
    lambda: functopt.nadam(1e-3),
    lambda: functopt.nadamw(1e-3),
    lambda: functopt.adamw(1e-3, mu_dtype=torch.bfloat16),
    lambda: functopt.adam(1e-3, eps_root=1e-8),
    lambda: functopt.sgd(0.1, momentum=0.9, accumulator_dtype=torch.bfloat16),
    lambda: functopt.sgd(0.1, momentum=0.0),
    lambda: functopt.lion(1e-3),
    lambda: functopt.chain(functopt.scale_by_adam(), functopt.scale(1e-3)),  # ascent
], ids=["adam_nesterov", "nadam", "nadamw", "adamw_mu_dtype", "adam_eps_root",
        "sgd_accumulator", "sgd_zero_momentum", "lion", "ascent"])
def test_options_without_fused_form_are_explained(make: Callable[[], Any]) -> None:
    got = explain(make(), {"w": torch.zeros(3)})
    assert not got.fast and isinstance(got.reason, str) and got.reason


@pytest.mark.parametrize("make", [
    lambda: functopt.adam(1e-3, b1=torch.tensor(0.9)),
    lambda: functopt.adamw(1e-3, weight_decay=torch.tensor(0.1)),
    lambda: functopt.sgd(torch.tensor(0.1)),
    lambda: functopt.sgd(_schedule()),
], ids=["adam_tensor_b1", "adamw_tensor_wd", "sgd_tensor_lr", "sgd_schedule"])
def test_tensor_and_scheduled_hyperparameters_are_fused(make: Callable[[], Any]) -> None:
    tx = make()
    params = _params(2)
    assert explain(tx, params).fast
    state = tx.init(params)
    grads = _grads(2, params, 0)
    got = make_step(tx)(grads, state, params)
    _assert_close_trees(got, _pure_step(tx, grads, state, params), rel=REL_FLOAT64)


# ----------------------------------------------------------------------------- errors

def test_make_step_rejects_non_transforms() -> None:
    with pytest.raises(TypeError, match="GradientTransformation, got function"):
        make_step(functopt.adamw)  # the factory, not a transform
    with pytest.raises(TypeError, match="GradientTransformation, got tuple"):
        make_step((lambda p: None, lambda g, s, p=None: (g, s)))


@pytest.mark.parametrize("make", [lambda: functopt.adamw(1e-2), lambda: functopt.lion(1e-3)],
                         ids=["fused", "fallback"])
def test_grads_unlike_params_raise_naming_the_leaf(make: Callable[[], Any]) -> None:
    tx = make()
    params = {"layer": {"w": torch.ones(3), "b": torch.ones(2)}}
    state = tx.init(params)
    step = make_step(tx)
    with pytest.raises(ValueError, match=r"'layer'.*missing key 'b'"):
        step({"layer": {"w": torch.ones(3)}}, state, params)
    with pytest.raises(ValueError, match=r"'layer\.w': grad has shape \(4,\)"):
        step({"layer": {"w": torch.ones(4), "b": torch.ones(2)}}, state, params)
    with pytest.raises(TypeError, match=r"'layer\.w': float64 grad for float32 param"):
        step({"layer": {"w": torch.ones(3, dtype=torch.float64), "b": torch.ones(2)}},
             state, params)
    with pytest.raises(TypeError, match=r"'layer\.b'"):
        step({"layer": {"w": torch.ones(3), "b": torch.ones(2, dtype=torch.int64)}},
             state, params)


# ------------------------------------------------------------------------- hypothesis

@given(fst.params_and_gradients(grad_kind="any", allow_none=True, max_leaves=5),
       st.booleans())
def test_property_adamw_matches_pure(pair: tuple[Any, Any], donate: bool) -> None:
    """Random pytrees of mixed dtypes (0-d and empty leaves, huge, tiny and non-finite
    gradients, None gradients): one make_step(adamw) step against the pure step."""
    params, grads = pair
    tx = functopt.adamw(1e-2, weight_decay=0.1)
    state = tx.init(params)
    want_params, want_state = _pure_step(tx, grads, state, params)
    got_params, got_state = make_step(tx, donate=donate)(_clone(grads), _clone(state),
                                                         _clone(params))
    assert _layout(got_state) == _layout(want_state)
    for path, a, e in _pairs((got_params, got_state), (want_params, want_state)):
        if not isinstance(e, torch.Tensor) or not e.is_floating_point():
            assert torch.equal(a, e), path
            continue
        assert a.dtype == e.dtype and a.shape == e.shape, path
        finite = torch.isfinite(e)
        assert torch.equal(torch.isfinite(a), finite), f"{path}: non-finite pattern differs"
        assert torch.equal(torch.isnan(a), torch.isnan(e)), f"{path}: nan pattern differs"
        assert torch.equal(a[~finite & ~torch.isnan(e)], e[~finite & ~torch.isnan(e)]), path
        bound = REL_FLOAT64 if e.dtype == torch.float64 else ULPS[e.dtype] * torch.finfo(
            e.dtype).eps
        # Below the normal range the first moment (1 - b1) * g is subnormal: both paths
        # round it to the subnormal spacing, and Adam's first step divides it by about eps
        # (the second moment underflows to 0), so the two roundings may differ by a few
        # spacings times lr / ((1 - b1) * eps). The deep profile found such a case (g =
        # 1.1755e-38 in float32: 1.1e-6 relative, 1.3e-38 absolute); this absolute floor
        # is that far below any normal-range comparison.
        spacing = 2.0 ** -1074 if e.dtype == torch.float64 else 2.0 ** -149
        floor = spacing * (ULPS.get(e.dtype, 3.0) * 1e-2 / (0.1 * 1e-8))  # (no underflow)
        if e[finite].numel():
            diff = (a[finite].double() - e[finite].double()).abs().max().item()
            scale = e[finite].double().abs().max().item()
            assert diff <= bound * scale + floor, (
                f"{path}: |diff| {diff:.3g} > {bound:.3g} * {scale:.3g} + {floor:.3g}")


# ---------------------------------------------------------------------------- compile

# Importing inductor on the CPU defines torch.utils.mkldnn's ScriptModules, which warn.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_compile_equals_pure() -> None:
    tx = functopt.adamw(1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(11)
    params = {"w": torch.randn(4, 3, generator=gen, dtype=torch.float64),
              "b": torch.randn(3, generator=gen, dtype=torch.float64)}
    state, ref_params, ref_state = tx.init(params), _clone(params), tx.init(params)
    step = make_step(tx, compile=True)
    start = time.monotonic()
    for i in range(3):
        grads = {k: torch.randn(v.shape, generator=gen, dtype=torch.float64)
                 for k, v in params.items()}
        params, state = step(grads, state, params)
        ref_params, ref_state = _pure_step(tx, grads, ref_state, ref_params)
        _assert_close_trees((params, state), (ref_params, ref_state), rel=REL_FLOAT64,
                            what=f"step {i}")
    assert _layout(state) == _layout(ref_state)
    print(f"compile=True: 3 steps in {time.monotonic() - start:.1f} s")


def test_injected_hyperparameters_are_read_every_step() -> None:
    """An edit of state.hyperparams between steps reaches the kernel (as the pure update),
    and a hyperparameter that requires grad keeps the step on the pure, differentiable
    path."""
    tx = functopt.inject_hyperparams(functopt.adamw)(learning_rate=1e-2, weight_decay=0.1)
    def edit(i: int, s: Any) -> None:
        if i == 2:
            s.hyperparams["learning_rate"] = torch.tensor(3e-3, dtype=torch.float64)
            s.hyperparams["weight_decay"] = torch.tensor(0.5, dtype=torch.float64)

    step = make_step(tx)
    params, _ = _edited_steps(tx, step, edit)
    lr = torch.tensor(1e-2, dtype=torch.float64, requires_grad=True)
    state = tx.init(params)
    state.hyperparams["learning_rate"] = lr
    grads = _grads(3, params, 0)
    assert not _kernel_takes(tx, grads, state, params)
    new, _ = step(grads, state, params)
    (d_lr,) = torch.autograd.grad(new["w"].sum(), lr)  # the pure path kept the graph
    assert torch.isfinite(d_lr) and d_lr != 0


def test_a_nested_injection_resolves_both_levels_at_every_step() -> None:
    """inject_hyperparams inside inject_hyperparams, the inner learning rate a schedule of
    the outer's value: the pure outer update builds the inner injection from the outer's
    values, so an edit of the outer value reaches the inner schedule at the next step. The
    kernel's lr is that value (it was the one of the planning step, silently)."""
    tx = functopt.inject_hyperparams(lambda peak: functopt.inject_hyperparams(functopt.sgd)(
        learning_rate=lambda count: peak * 0.5 ** count, momentum=0.9))(peak=0.1)
    def edit(i: int, s: Any) -> None:
        if i in (1, 3):
            s.hyperparams["peak"] = torch.tensor(10.0 * i, dtype=torch.float64)
            s.inner_state.hyperparams["momentum"] = torch.tensor(0.5 / i, dtype=torch.float64)

    _, state = _edited_steps(tx, make_step(tx), edit)
    assert float(state.inner_state.hyperparams["learning_rate"]) == 30.0 * 0.5 ** 3


def _edited_steps(tx: Any, step: Any, edit: Callable[[int, Any], None]) -> tuple[Any, Any]:
    """Four steps of ``step`` and of the pure path, ``edit(i, state)`` applied to both
    states before step ``i``; each step on the kernels and equal to the pure one."""
    params = _params(3)
    state, ref_state, ref_params = tx.init(params), tx.init(params), _clone(params)
    for i in range(4):
        edit(i, state)
        edit(i, ref_state)
        grads = _grads(3, ref_params, i)
        assert _kernel_takes(tx, grads, state, params)
        params, state = step(_clone(grads), state, params)
        ref_params, ref_state = _pure_step(tx, grads, ref_state, ref_params)
        _assert_close_trees(params, ref_params, rel=REL_FLOAT64, what=f"step {i} params")
        _assert_close_trees(state, ref_state, rel=REL_FLOAT64, what=f"step {i} state")
    return params, state


def test_a_clip_of_finite_huge_gradients_is_finite_without_a_host_read(monkeypatch) -> None:
    """The planner's clip on gradients whose float32 sum of squares overflows (1e30) but
    which are finite: on an accelerator (here the CPU with the host-read branch turned
    off, as on a GPU) every leaf is measured again in float64 and selected on the device,
    so the step is finite and equal to the pure path's, as on the CPU."""
    from functopt.tree import _ops

    monkeypatch.setattr(_ops, "_host_branch_ok", lambda x: False)
    tx = functopt.chain(functopt.clip_by_global_norm(1.0), functopt.adamw(0.1))
    params = {"big": torch.ones(4), "fine": torch.ones(2, 3)}
    grads = {"big": torch.full((4,), 1e30), "fine": torch.full((2, 3), 0.5)}
    step = make_step(tx)
    new, _ = step(grads, tx.init(params), params)
    updates, _ = tx.update(grads, tx.init(params), params)
    pure = functopt.apply_updates(params, updates)
    for k in params:
        assert torch.isfinite(new[k]).all(), k
        torch.testing.assert_close(new[k], pure[k], rtol=1e-6, atol=1e-7)
    assert not torch.equal(new["big"], params["big"])  # a real step, not a skip
