"""The rule protocol (``functopt.elementwise_rule``, ``per_leaf_rule``, ``state_slots``): a
rule written with public API only, as in a user's own file, reaches the fast tiers, and
``explain`` names it.

The elementwise rule is Adan (Xie et al. 2022, "Adan: Adaptive Nesterov Momentum
Algorithm for Faster Optimizing Deep Models"): three moments, of the gradient, of the
gradient's difference from the previous step's, and of the square of their Nesterov
combination. Its compiled step is held to its pure path by the conformance law (float64 to
1e-12: Inductor orders the arithmetic its own way); the per-leaf tier runs a rule's own
update, so a per-leaf rule's fast step is the pure one bitwise. (The program engine's law,
tests/laws/test_program.py, takes both kinds of rule through the conformance registry's
``elementwise_rule`` and ``per_leaf_rule`` entries.)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from compiled_cases import every_layout, grads_for

import functopt
from functopt import Params, Updates, fast
from functopt.testing import assert_bitwise_equal, clone_tree, conformance

# Importing Inductor on the CPU defines torch.utils.mkldnn's ScriptModules, which warn.
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


# --- a user's file: public API only -------------------------------------------------------

class ScaleByAdanState(NamedTuple):
    count: torch.Tensor  # int32, shape (): steps taken
    m: Updates  # like params: EMA of the gradient
    v: Updates  # like params: EMA of the gradient's difference from the previous one
    n: Updates  # like params: EMA of the square of (gradient + b2 * difference)
    prev: Updates  # like params: the previous step's gradient


def scale_by_adan(b1: float = 0.98, b2: float = 0.92, b3: float = 0.99,
                  eps: float = 1e-8) -> functopt.GradientTransformation:
    """Adan's direction, bias corrected as in the authors' PyTorch code (the first step's
    difference is 0)."""

    def init_fn(params: Params) -> ScaleByAdanState:
        def zeros() -> Any:
            return functopt.tree.map(torch.zeros_like, params)

        return ScaleByAdanState(torch.zeros((), dtype=torch.int32), zeros(), zeros(),
                                zeros(), zeros())

    def update_fn(updates: Updates, state: ScaleByAdanState, params: Params | None = None,
                  ) -> tuple[Updates, ScaleByAdanState]:
        count = state.count + 1
        later = count > 1  # (a 0-d tensor: no host read, no recompile per step)
        tree = functopt.tree
        # (a leaf without a gradient keeps its state: None in ``updates``)
        diffs = tree.map(lambda g, p: torch.where(later, g - p, torch.zeros_like(g)),
                         updates, state.prev)
        m = tree.map(lambda o, g: o if g is None else b1 * o + (1 - b1) * g, state.m, updates)
        v = tree.map(lambda o, d: o if d is None else b2 * o + (1 - b2) * d, state.v, diffs)

        def second(o: torch.Tensor, g: torch.Tensor | None, d: torch.Tensor | None) -> Any:
            if g is None or d is None:
                return o
            u = g + b2 * d
            return b3 * o + (1 - b3) * u * u

        n = tree.map(second, state.n, updates, diffs)
        prev = tree.map(lambda o, g: o if g is None else g, state.prev, updates)

        def direction(g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                      n: torch.Tensor) -> torch.Tensor:
            t = count.to(g.dtype)
            bc1, bc2, bc3 = 1 - b1 ** t, 1 - b2 ** t, 1 - b3 ** t
            return (m / bc1 + b2 * v / bc2) / (n.sqrt() / bc3.sqrt() + eps)

        out = tree.map(direction, updates, m, v, n)
        return out, ScaleByAdanState(count, m, v, n, prev)

    return functopt.elementwise_rule(
        functopt.GradientTransformation(init_fn, update_fn), "scale_by_adan",
        state=ScaleByAdanState, hyperparams={"b1": b1, "b2": b2, "b3": b3, "eps": eps})


def adan(learning_rate: float = 1e-2, weight_decay: float = 0.02,
         ) -> functopt.GradientTransformation:
    return functopt.chain(scale_by_adan(), functopt.add_decayed_weights(weight_decay),
                          functopt.scale_by_learning_rate(learning_rate))


class NormalizeState(NamedTuple):
    count: torch.Tensor  # int32, shape (): steps taken
    norm: Updates  # like params: each leaf's last update norm, broadcast


def normalize(min_norm: float = 1e-12) -> functopt.GradientTransformation:
    """Each leaf's update scaled to unit norm (a rule on each leaf whole)."""

    def init_fn(params: Params) -> NormalizeState:
        return NormalizeState(torch.zeros((), dtype=torch.int32),
                              functopt.tree.map(torch.zeros_like, params))

    def update_fn(updates: Updates, state: NormalizeState, params: Params | None = None,
                  ) -> tuple[Updates, NormalizeState]:
        norms = functopt.tree.map(lambda g: g.norm().clamp_min(min_norm), updates)
        out = functopt.tree.map(lambda g, r: g / r, updates, norms)
        kept = functopt.tree.map(lambda o, r: o if r is None else torch.full_like(o, r),
                                 state.norm, norms)
        return out, NormalizeState(state.count + 1, kept)

    return functopt.per_leaf_rule(functopt.GradientTransformation(init_fn, update_fn),
                                  "normalize", state=NormalizeState,
                                  hyperparams={"min_norm": min_norm})


# --- the tests ----------------------------------------------------------------------------

def test_state_slots_read_the_annotations() -> None:
    assert functopt.state_slots(ScaleByAdanState) == ("m", "v", "n", "prev")
    assert functopt.state_slots(functopt.EmptyState) == ()

    class Wrong(NamedTuple):
        count: torch.Tensor
        m: list[torch.Tensor]

    with pytest.raises(TypeError, match=r"Wrong\.m is annotated .*functopt\.Updates"):
        functopt.state_slots(Wrong)
    with pytest.raises(TypeError, match="expected a NamedTuple class"):
        functopt.state_slots(dict)


def test_a_rule_needs_a_name_of_its_own() -> None:
    tx = functopt.GradientTransformation(lambda p: functopt.EmptyState(),
                                         lambda u, s, p=None: (u, s))
    with pytest.raises(ValueError, match=r"functopt's own functopt\.identity"):
        functopt.elementwise_rule(tx, "identity", state=functopt.EmptyState)
    with pytest.raises(ValueError, match="as an identifier"):
        functopt.per_leaf_rule(tx, "my rule", state=functopt.EmptyState)
    with pytest.raises(ValueError, match="only one of sums and finish"):
        functopt.elementwise_rule(tx, "mine", state=functopt.EmptyState, sums=lambda *a: ())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_explain_names_a_users_elementwise_rule_on_the_compiled_tier(dtype: torch.dtype,
                                                                     ) -> None:
    params = every_layout(dtype)
    plain = fast.explain(adan(), params)
    assert not plain.fast and "scale_by_adan has no fused kernel" in str(plain.reason)
    got = fast.explain(adan(), params, compile=True)
    assert got.fast, str(got)
    assert {g.kernel for g in got.groups} == {"compiled"}
    assert {g.rules for g in got.groups} == {
        ("scale_by_adan", "add_decayed_weights", "scale_by_learning_rate")}
    assert "scale_by_adan(b1=0.98" in repr(adan())


@pytest.mark.parametrize("dtype", [
    torch.float64, pytest.param(torch.float32, marks=pytest.mark.slow)])
def test_a_users_elementwise_rule_compiled_equals_its_pure_path(dtype: torch.dtype) -> None:
    """Three steps over every layout (contiguous, channels_last, transposed, 0-d, empty),
    donated or not, the state from tx.init and from step.init (one compile per dtype)."""
    params = every_layout(dtype)
    conformance.check_fast_path(adan, params, grads_for(params, 1), steps=3, compile=True)


def test_a_users_elementwise_rule_compiled_matches_torch_foreach_adan() -> None:
    """The rule is Adan: its compiled step equals the hand-written torch._foreach_ Adan
    that benchmarks/adan.py times it against (float64, three steps)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from adan import foreach_adan_

    lr, wd = 1e-2, 0.02
    params = every_layout(torch.float64)
    step = fast.make_step(adan(learning_rate=lr, weight_decay=wd), compile=True)
    state = step.init(params)
    ours = clone_tree(params)
    keys = [k for k in params if params[k].numel()]
    theirs = [params[k].clone() for k in keys]
    buffers = [[torch.zeros_like(p) for p in theirs] for _ in range(4)]
    for t in range(1, 4):
        grads = grads_for(params, t)
        with torch.no_grad():
            ours, state = step(grads, state, ours)
        foreach_adan_(theirs, [grads[k] for k in keys], *buffers, t, lr=lr, weight_decay=wd)
    for k, expected in zip(keys, theirs, strict=True):
        torch.testing.assert_close(ours[k], expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("donate", [False, True])
def test_a_users_per_leaf_rule_takes_the_per_leaf_tier_bitwise(donate: bool) -> None:
    """The per-leaf tier runs the rule's own update on each group's leaves: the same
    arithmetic as the pure path, so bitwise, over every layout and two dtypes."""
    params = {**every_layout(torch.float64),
              **{f"{k}32": v for k, v in every_layout(torch.float32, seed=1).items()}}
    tx = functopt.chain(normalize(), functopt.add_decayed_weights(0.1),
                        functopt.scale_by_learning_rate(1e-2))
    got = fast.explain(tx, params)
    assert got.fast, str(got)
    assert {g.kernel for g in got.groups} == {"per-leaf"}
    assert {g.rules for g in got.groups} == {
        ("normalize", "add_decayed_weights", "scale_by_learning_rate")}
    step = fast.make_step(tx, donate=donate)
    state, pure_state = tx.init(params), tx.init(params)
    ours, pure = clone_tree(params), clone_tree(params)
    for t in range(3):
        grads = grads_for(params, t)
        updates, pure_state = tx.update(grads, pure_state, pure)
        pure = functopt.apply_updates(pure, updates)
        with torch.no_grad():
            ours, state = step(grads, state, ours)
        assert_bitwise_equal(ours, pure, what="params")
        assert_bitwise_equal(state, pure_state, what="state")
