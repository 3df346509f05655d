"""``centralize`` and ``adaptive_grad_clip`` on the planner's per-leaf tier
(functopt/fast/_perleaf.py).

Both reduce within a leaf (each output unit's mean; each unit's norm against its param's):
they carry a ``PerLeaf`` spec without a grouped update, so the tier calls their own
``update`` on a group's leaves, once per step, and the rules around them run as they run
beside Adafactor's. The step is the pure path's arithmetic, so it is held bitwise to it
here, over the layouts of tests/test_perleaf_adafactor.py (same-shape, transposed,
channels_last, strided, 3-D, empty and 0-d leaves); the conformance suite
(tests/test_conformance.py) holds them to the law on drawn trees. Their values are held to
references in tests/test_projection.py and tests/test_clipping.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_perleaf_adafactor import _grads_like, _mixed_steps, _model, _steps
from test_perleaf_fast import _fast, _pure

import functopt
from functopt.testing import assert_bitwise_equal, clone_tree

F = functopt

_CHAINS = {
    "centralize, adamw": lambda: F.chain(F.centralize(), F.adamw(1e-2, weight_decay=0.1)),
    "clip, agc, sgd": lambda: F.chain(F.clip_by_global_norm(2.0), F.adaptive_grad_clip(0.05),
                                      F.sgd(0.1, momentum=0.9)),
    "guard(agc, centralize, lion)": lambda: F.apply_if_finite(F.chain(
        F.adaptive_grad_clip(0.05, eps=1e-2), F.centralize(), F.lion(1e-3)), 3),
}


def test_explain_puts_them_on_the_per_leaf_tier() -> None:
    params = _model(torch.float32)
    for name, build in _CHAINS.items():
        got = functopt.fast.explain(build(), params)
        assert got.fast and {g.kernel for g in got.groups} == {"per-leaf"}, (name, str(got))
    got = functopt.fast.explain(_CHAINS["clip, agc, sgd"](), params)
    assert got.clips == 1 and [g.rules for g in got.groups] == [
        ("adaptive_grad_clip", "trace", "scale_by_learning_rate")]
    alone = functopt.fast.explain(F.centralize(), params)
    assert alone.fast and [g.rules for g in alone.groups] == [("centralize",)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", sorted(_CHAINS))
def test_fast_equals_pure_bitwise_over_layouts(name: str, dtype: torch.dtype) -> None:
    _steps(_CHAINS[name](), _model(dtype), donate=dtype == torch.float32)


def test_leaves_without_a_gradient_and_an_axis() -> None:
    # axis=(1,): the rows of every matrix are its units (a 3-D leaf's too, per last dim)
    params = {k: v for k, v in _model(torch.float64).items() if v.dim() >= 2}
    _steps(F.chain(F.adaptive_grad_clip(0.05, axis=(1,)), F.centralize(), F.adamw(1e-2)),
           params, frozen=("a", "cl"))


@pytest.mark.parametrize("donate", [False, True])
def test_a_skipped_step_keeps_params_and_state(donate: bool) -> None:
    tx = _CHAINS["guard(agc, centralize, lion)"]()
    params = _model(torch.float64)
    state = tx.init(params)
    grads = _grads_like(params, 7)
    grads["cl"][1, 2, 0, 3] = float("inf")
    pure_p, pure_s = _pure(tx, grads, state, params)
    before = clone_tree(params)
    fast_p, fast_s = _fast(functopt.fast.make_step(tx, donate=donate), grads,
                           clone_tree(state), params)
    assert_bitwise_equal(fast_p, before)
    assert_bitwise_equal(fast_p, pure_p)
    assert_bitwise_equal(fast_s, pure_s)
    assert int(fast_s.notfinite_count) == 1


def test_an_injected_clipping_is_read_at_every_step() -> None:
    # a scheduler writes state.hyperparams between steps: the tier runs the clip built from
    # the new value, bitwise the pure inject_hyperparams
    tx = F.chain(F.inject_hyperparams(F.adaptive_grad_clip)(clipping=0.05), F.sgd(0.1))
    params = _model(torch.float64)
    state = tx.init(params)
    step = functopt.fast.make_step(tx)
    assert functopt.fast.explain(tx, params).fast
    moved: list[Any] = []
    for i, clipping in enumerate([0.05, 1e-3, 10.0]):
        inner = state[0]._replace(hyperparams={
            **state[0].hyperparams, "clipping": torch.tensor(clipping, dtype=torch.float64)})
        state = (inner, *state[1:])
        grads = _grads_like(params, 30 + i)
        pure_p, pure_s = _pure(tx, grads, state, params)
        fast_p, fast_s = _fast(step, grads, clone_tree(state), clone_tree(params))
        assert_bitwise_equal(fast_p, pure_p)
        assert_bitwise_equal(fast_s, pure_s)
        moved.append(float((pure_p["a"] - params["a"]).abs().max()))
        params, state = pure_p, pure_s
    assert moved[1] < moved[0] < moved[2]  # the value was read: it clips more, then less


def test_mixed_precision_takes_the_tier_and_equals_its_pure_step() -> None:
    full = {k: v.to(torch.bfloat16) for k, v in _model(torch.float32).items()
            if v.is_contiguous()}

    def build() -> functopt.GradientTransformation:
        return F.chain(F.adaptive_grad_clip(0.05), F.centralize(), F.adamw(1e-2))

    fp, fs, ps = _mixed_steps(build, full, steps=4, seed=50, overflow_at=1)
    assert_bitwise_equal(fs.master, ps.master)
    assert_bitwise_equal(fs.inner_state, ps.inner_state)
    assert all(torch.equal(fs.master[k].to(torch.bfloat16), p) for k, p in fp.items())
    assert int(fs.metrics.skipped_steps) == 1
