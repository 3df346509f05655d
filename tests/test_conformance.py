"""Every built-in transform and recipe through the conformance suite, and the suite's own tests.

The registry below names each public transform factory with hyperparameters that exercise
it. Entries whose name does not exist (yet) in ``functopt`` are left out, and
``test_registry_covers_public_api`` fails when a public factory has no entry: add one here
when you add a transform.
"""

from __future__ import annotations

import inspect
import io
import pickle
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import functopt
from functopt.testing import _compare, conformance
from functopt.testing import strategies as fst
from functopt.tree import _core

# --- the registry --------------------------------------------------------------------------


class Entry(NamedTuple):
    id: str  # test id
    name: str  # the public name it exercises (functopt.<name>)
    factory: Callable[[], Any]  # builds the transform
    needs_params: bool  # update reads the params (else it runs without them)


def every_other(params: Any, first: Any = True, second: Any = False) -> Any:
    """``first`` at leaves 0, 2, 4, ... of ``params``, ``second`` at the others."""
    leaves, spec = _core.flatten(params)
    return _core.unflatten(spec, [first if i % 2 == 0 else second for i in range(len(leaves))])


def double_tree(updates: Any, params: Any) -> Any:
    del params
    return optree.tree_map(lambda g: None if g is None else g * 2, updates, none_is_leaf=True,
                           namespace=_core.NAMESPACE)


def without_extra_args() -> functopt.GradientTransformation:
    """A user transform whose update does not take ``**extra_args``."""

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        return double_tree(updates, params), state

    return functopt.GradientTransformation(lambda params: (), update)


def inverse_count(count: torch.Tensor) -> torch.Tensor:
    return 1.0 / (count + 1)


def halved_momentum() -> functopt.GradientTransformation:
    """A user's elementwise rule (``functopt.elementwise_rule``): a trace of the gradients,
    halved."""

    def init(params: Any) -> functopt.TraceState:
        return functopt.TraceState(functopt.tree.map(torch.zeros_like, params))

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        trace = functopt.tree.map(lambda t, g: t if g is None else 0.9 * t + g,
                                  state.trace, updates)
        return (functopt.tree.map(lambda g, t: 0.5 * t, updates, trace),
                functopt.TraceState(trace))

    return functopt.elementwise_rule(functopt.GradientTransformation(init, update),
                                     "halved_momentum", state=functopt.TraceState)


def leaf_normalized() -> functopt.GradientTransformation:
    """A user's rule on each leaf whole (``functopt.per_leaf_rule``)."""

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        return functopt.tree.map(lambda g: g / (1 + g.abs().sum()), updates), state

    return functopt.per_leaf_rule(
        functopt.GradientTransformation(lambda params: functopt.EmptyState(), update),
        "leaf_normalized", state=functopt.EmptyState)


F = functopt
_CANDIDATES: list[tuple[str, str, Callable[[], Any], bool]] = [
    # core
    ("identity", "identity", lambda: F.identity(), False),
    ("set_to_zero", "set_to_zero", lambda: F.set_to_zero(), False),
    ("stateless", "stateless", lambda: F.stateless(double_tree), False),
    ("stateless_with_tree_map", "stateless_with_tree_map",
     lambda: F.stateless_with_tree_map(lambda g, p: g * 2), False),
    ("with_extra_args_support", "with_extra_args_support",
     lambda: F.with_extra_args_support(without_extra_args()), False),
    ("elementwise_rule", "elementwise_rule", halved_momentum, False),
    ("per_leaf_rule", "per_leaf_rule", leaf_normalized, False),
    # scaling
    ("scale", "scale", lambda: F.scale(0.5), False),
    ("scale[tensor]", "scale", lambda: F.scale(torch.tensor(0.5)), False),
    ("scale_by_learning_rate", "scale_by_learning_rate", lambda: F.scale_by_learning_rate(0.1),
     False),
    ("scale_by_learning_rate[schedule]", "scale_by_learning_rate",
     lambda: F.scale_by_learning_rate(inverse_count), False),
    ("scale_by_schedule", "scale_by_schedule", lambda: F.scale_by_schedule(inverse_count),
     False),
    # moments
    ("scale_by_adam", "scale_by_adam", lambda: F.scale_by_adam(), False),
    ("scale_by_adam[nesterov,bf16-mu]", "scale_by_adam",
     lambda: F.scale_by_adam(nesterov=True, mu_dtype=torch.bfloat16), False),
    ("scale_by_amsgrad", "scale_by_amsgrad", lambda: F.scale_by_amsgrad(), False),
    ("scale_by_rms", "scale_by_rms", lambda: F.scale_by_rms(), False),
    ("scale_by_rms[bias_correction]", "scale_by_rms",
     lambda: F.scale_by_rms(eps_in_sqrt=False, bias_correction=True), False),
    ("scale_by_stddev", "scale_by_stddev", lambda: F.scale_by_stddev(), False),
    ("scale_by_rss", "scale_by_rss", lambda: F.scale_by_rss(), False),
    ("scale_by_lion", "scale_by_lion", lambda: F.scale_by_lion(), False),
    ("scale_by_amsgrad[correct_after_max]", "scale_by_amsgrad",
     lambda: F.scale_by_amsgrad(correct_after_max=True), False),
    ("scale_by_rss[eps outside]", "scale_by_rss",
     lambda: F.scale_by_rss(eps=1e-10, eps_in_sqrt=False), False),
    ("scale_by_adamax", "scale_by_adamax", lambda: F.scale_by_adamax(), False),
    ("scale_by_radam", "scale_by_radam", lambda: F.scale_by_radam(), False),
    ("scale_by_radam[torch eps,nesterov]", "scale_by_radam",
     lambda: F.scale_by_radam(eps_before_correction=True, nesterov=True, threshold=4.5), False),
    ("scale_by_nadam", "scale_by_nadam", lambda: F.scale_by_nadam(momentum_decay=0.1), False),
    ("scale_by_adadelta", "scale_by_adadelta", lambda: F.scale_by_adadelta(), False),
    ("scale_by_rprop", "scale_by_rprop", lambda: F.scale_by_rprop(0.01), False),
    ("scale_by_sign", "scale_by_sign", lambda: F.scale_by_sign(), False),
    ("scale_by_trust_ratio", "scale_by_trust_ratio", lambda: F.scale_by_trust_ratio(), True),
    ("scale_by_factored_rms", "scale_by_factored_rms",
     lambda: F.scale_by_factored_rms(min_dim_size_to_factor=2), False),
    ("scale_by_factored_rms[unfactored]", "scale_by_factored_rms",
     lambda: F.scale_by_factored_rms(factored=False), False),
    ("scale_by_param_block_norm", "scale_by_param_block_norm",
     lambda: F.scale_by_param_block_norm(), True),
    ("scale_by_param_block_rms", "scale_by_param_block_rms",
     lambda: F.scale_by_param_block_rms(), True),
    # clipping, adding, accumulation, constraints, projection
    ("clip", "clip", lambda: F.clip(0.5), False),
    ("clip_by_block_rms", "clip_by_block_rms", lambda: F.clip_by_block_rms(0.5), False),
    ("clip_by_global_norm", "clip_by_global_norm", lambda: F.clip_by_global_norm(1.0), False),
    ("adaptive_grad_clip", "adaptive_grad_clip", lambda: F.adaptive_grad_clip(0.1), True),
    ("add_decayed_weights", "add_decayed_weights", lambda: F.add_decayed_weights(1e-2), True),
    ("trace", "trace", lambda: F.trace(decay=0.9), False),
    ("trace[nesterov]", "trace", lambda: F.trace(decay=0.9, nesterov=True), False),
    ("dampened_trace", "dampened_trace", lambda: F.dampened_trace(0.9, dampening=0.5), False),
    ("dampened_trace[nesterov]", "dampened_trace",
     lambda: F.dampened_trace(0.9, dampening=0.1, nesterov=True), False),
    ("ema", "ema", lambda: F.ema(decay=0.9), False),
    ("ema[debias=False]", "ema", lambda: F.ema(decay=0.9, debias=False), False),
    ("zero_nans", "zero_nans", lambda: F.zero_nans(), False),
    ("keep_params_nonnegative", "keep_params_nonnegative",
     lambda: F.keep_params_nonnegative(), True),
    ("centralize", "centralize", lambda: F.centralize(), False),
    # combinators
    ("chain", "chain", lambda: F.chain(F.clip(1.0), F.scale_by_adam(), F.scale(-0.1)), False),
    ("chain[empty]", "chain", lambda: F.chain(), False),
    ("named_chain", "named_chain",
     lambda: F.named_chain(("adam", F.scale_by_adam()), ("lr", F.scale(-0.1))), False),
    ("masked", "masked", lambda: F.masked(F.scale_by_adam(), every_other), False),
    ("partition", "partition",
     lambda: F.partition({"adam": F.scale_by_adam(), "frozen": F.set_to_zero()},
                         lambda p: every_other(p, "adam", "frozen")), False),
    ("apply_if_finite", "apply_if_finite",
     lambda: F.apply_if_finite(F.scale_by_adam(), max_consecutive_errors=1), False),
    ("MultiSteps", "MultiSteps", lambda: F.MultiSteps(F.scale_by_adam(), every_k_schedule=2),
     False),
    ("MultiSteps.gradient_transformation", "MultiSteps",
     lambda: F.MultiSteps(F.scale_by_adam(), every_k_schedule=1).gradient_transformation(),
     False),
    ("inject_hyperparams", "inject_hyperparams",
     lambda: F.inject_hyperparams(F.scale_by_adam)(b1=0.9, b2=0.99), False),
    ("inject_hyperparams[schedule]", "inject_hyperparams",
     lambda: F.inject_hyperparams(F.scale)(step_size=inverse_count), False),
    # recipes
    ("sgd", "sgd", lambda: F.sgd(0.1), False),
    ("sgd[nesterov]", "sgd", lambda: F.sgd(0.1, momentum=0.9, nesterov=True), False),
    ("adam", "adam", lambda: F.adam(1e-3), False),
    ("adam[tensor lr]", "adam", lambda: F.adam(torch.tensor(1e-3)), False),
    ("adamw", "adamw", lambda: F.adamw(1e-3), True),
    ("nadam", "nadam", lambda: F.nadam(1e-3), False),
    ("nadamw", "nadamw", lambda: F.nadamw(1e-3), True),
    ("amsgrad", "amsgrad", lambda: F.amsgrad(1e-3), False),
    ("lion", "lion", lambda: F.lion(1e-4), True),
    ("rmsprop", "rmsprop", lambda: F.rmsprop(1e-2), False),
    ("rmsprop[centered,momentum]", "rmsprop",
     lambda: F.rmsprop(1e-2, centered=True, momentum=0.9), False),
    ("adagrad", "adagrad", lambda: F.adagrad(1e-1), False),
    ("lamb", "lamb", lambda: F.lamb(1e-3, weight_decay=1e-2), True),
    ("lars", "lars", lambda: F.lars(1e-1, weight_decay=1e-2), True),
    ("adafactor", "adafactor", lambda: F.adafactor(1e-2, min_dim_size_to_factor=2), True),
    ("sign_sgd", "sign_sgd", lambda: F.sign_sgd(0.1), False),
    ("adamax", "adamax", lambda: F.adamax(2e-3), False),
    ("adadelta", "adadelta", lambda: F.adadelta(weight_decay=1e-2), True),
    ("radam", "radam", lambda: F.radam(1e-3), False),
    ("rprop", "rprop", lambda: F.rprop(1e-2), False),
]

REGISTRY: list[Entry] = [Entry(*c) for c in _CANDIDATES if hasattr(functopt, c[1])]


def _is_transform_factory(name: str, obj: Any) -> bool:
    """Whether ``functopt.<name>`` builds transforms: a function annotated to return a
    GradientTransformation, or a class with ``init`` and ``update`` methods (MultiSteps)."""
    if inspect.isclass(obj):
        return not issubclass(obj, tuple) and all(
            inspect.isfunction(getattr(obj, m, None)) for m in ("init", "update"))
    if not inspect.isfunction(obj):
        return False
    returns = inspect.signature(obj).return_annotation
    text = returns if isinstance(returns, str) else getattr(returns, "__name__", str(returns))
    return re.fullmatch(r"(functopt\.)?GradientTransformation", text) is not None


def test_registry_covers_public_api() -> None:
    covered = {e.name for e in REGISTRY}
    public = [n for n in functopt.__all__ if _is_transform_factory(n, getattr(functopt, n))]
    missing = sorted(set(public) - covered)
    assert not missing, (
        f"public transform factories without a conformance entry: {missing}. Add an Entry "
        f"for each to _CANDIDATES in tests/test_conformance.py."
    )
    # The detector finds the factories we know about, so an empty list above means something.
    assert {"scale", "scale_by_adam", "chain", "identity"} <= set(public)


def test_registry_ids_are_unique() -> None:
    ids = [c[0] for c in _CANDIDATES]
    assert len(ids) == len(set(ids))


# --- every registered transform through the suite ------------------------------------------


def _cases(grad_kind: fst.ValueKind) -> st.SearchStrategy[tuple[Any, Any, Any]]:
    return conformance.cases(grad_kind=grad_kind, max_leaves=4)


@pytest.mark.parametrize("grad_kind", ["finite", "any"])
@pytest.mark.parametrize("entry", REGISTRY, ids=[e.id for e in REGISTRY])
@settings(max_examples=4)
@given(data=st.data())
def test_builtin_conforms(entry: Entry, grad_kind: fst.ValueKind, data: st.DataObject) -> None:
    params, grads, mask = data.draw(_cases(grad_kind), label="params, grads, mask")
    conformance.check_transform(entry.factory, params, grads, mask=mask,
                                with_params=entry.needs_params)


@pytest.mark.parametrize("entry", [e for e in REGISTRY if not e.needs_params],
                         ids=[e.id for e in REGISTRY if not e.needs_params])
def test_builtin_conforms_with_params_too(entry: Entry) -> None:
    # Transforms that do not read params must also accept them.
    params = {"a": torch.ones(2, 3), "b": [torch.zeros((), dtype=torch.float64), None],
              "c": torch.ones(0, dtype=torch.bfloat16)}
    grads = {"a": torch.full((2, 3), 0.25), "b": [torch.tensor(float("nan"), dtype=torch.float64),
                                                  None], "c": torch.ones(0, dtype=torch.bfloat16)}
    conformance.check_transform(entry.factory, params, grads, with_params=True)


# --- the suite finds what it claims to find ------------------------------------------------

PARAMS = {"w": torch.ones(3), "b": torch.zeros((), dtype=torch.float16), "n": None}
GRADS = {"w": torch.tensor([0.5, float("nan"), -1.0]), "b": torch.tensor(2.0, dtype=torch.float16),
         "n": None}


def make(update: Callable[..., Any], init: Callable[[Any], Any] = lambda p: ()) -> Any:
    return lambda: functopt.GradientTransformation(init, update)


def map_grads(fn: Callable[[torch.Tensor], Any]) -> Callable[..., Any]:
    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any, Any]:
        return {k: None if g is None else fn(g) for k, g in updates.items()}, state

    return update


def test_conforming_user_transform_passes() -> None:
    conformance.check_transform(make(map_grads(lambda g: -g)), PARAMS, GRADS)


def test_purity_catches_in_place_write_even_of_same_values() -> None:
    tx = make(map_grads(lambda g: g.mul_(1)))
    with pytest.raises(AssertionError, match=r"check_purity: update \(step 1\) mutated leaf 'b' "
                                             r"of grads in place: its version counter moved"):
        conformance.check_purity(tx, PARAMS, GRADS)


def test_purity_catches_mutation_of_params_in_init() -> None:
    def init(params: Any) -> Any:
        params["w"].add_(1)
        return ()

    with pytest.raises(AssertionError, match=r"init mutated leaf 'w' of params in place.*"
                                             r"3 of 3 elements differ"):
        conformance.check_purity(make(map_grads(lambda g: g), init), PARAMS | {"w": torch.ones(3)},
                                 GRADS)


def test_purity_catches_state_mutated_on_the_next_step() -> None:
    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        state["m"].add_(1.0)
        return updates, {"m": state["m"]}

    tx = make(update, lambda p: {"m": torch.zeros(())})
    with pytest.raises(AssertionError, match=r"update \(step 1\) mutated leaf 'm' of the state "
                                             r"returned by init in place"):
        conformance.check_purity(tx, PARAMS, GRADS)


def test_purity_catches_container_edits() -> None:
    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        updates["w"] = updates["w"] * 2
        return updates, state

    with pytest.raises(AssertionError, match=r"replaced leaf 'w' of grads by another object"):
        conformance.check_purity(make(update), PARAMS, dict(GRADS))

    def update_keys(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        updates["extra"] = None
        return updates, state

    with pytest.raises(AssertionError, match=r"edited the containers of grads in place "
                                             r"\(at '<root>': unexpected key 'extra'"):
        conformance.check_purity(make(update_keys), PARAMS, dict(GRADS))


def test_purity_accepts_returning_the_inputs_themselves() -> None:
    conformance.check_purity(lambda: functopt.identity(), PARAMS, GRADS)


def test_determinism_catches_hidden_closure_state() -> None:
    def factory() -> Any:
        calls = [0]

        def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
            calls[0] += 1
            return {k: None if g is None else g * calls[0] for k, g in updates.items()}, state

        return functopt.GradientTransformation(lambda p: (), update)

    with pytest.raises(AssertionError, match=r"check_determinism: updates of step 1 of a second "
                                             r"run of the same transform vs the first run: "
                                             r"leaf 'b'"):
        conformance.check_determinism(factory(), PARAMS, GRADS)


def test_determinism_catches_unseeded_randomness() -> None:
    tx = make(map_grads(lambda g: g + torch.rand_like(g)))
    with pytest.raises(AssertionError, match=r"check_determinism: .* elements differ bitwise"):
        conformance.check_determinism(tx, PARAMS, GRADS)


def test_layout_catches_dtype_change() -> None:
    tx = make(map_grads(lambda g: g.float()))
    with pytest.raises(AssertionError, match=r"check_layout: updates of step 1 vs the grads: "
                                             r"leaf 'b' has dtype torch.float32, expected "
                                             r"torch.float16"):
        conformance.check_layout(tx, PARAMS, GRADS)


def test_layout_catches_update_for_none_grad() -> None:
    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        return {k: torch.zeros(1) if g is None else g for k, g in updates.items()}, state

    with pytest.raises(AssertionError, match=r"leaf 'n' is a float32 tensor of shape \(1,\), "
                                             r"expected None"):
        conformance.check_layout(make(update), PARAMS, GRADS)


def test_layout_catches_missing_key() -> None:
    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        return {"w": updates["w"], "b": updates["b"]}, state

    with pytest.raises(AssertionError, match=r"different structures \(at '<root>': missing key "
                                             r"'n'"):
        conformance.check_layout(make(update), PARAMS, GRADS)


def test_layout_catches_state_that_changes_shape_or_structure() -> None:
    def grow(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        return updates, {"m": torch.cat([state["m"], state["m"]])}

    with pytest.raises(AssertionError, match=r"state after step 1 vs the state after init: "
                                             r"leaf 'm' has shape torch.Size\(\[2\]\), expected "
                                             r"torch.Size\(\[1\]\)"):
        conformance.check_layout(make(grow, lambda p: {"m": torch.zeros(1)}), PARAMS, GRADS)

    def restructure(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        return updates, [state]

    with pytest.raises(AssertionError, match=r"state after step 1 vs the state after init: "
                                             r"different structures"):
        conformance.check_layout(make(restructure, lambda p: {"m": torch.zeros(1)}), PARAMS,
                                 GRADS)


def test_layout_requires_tensor_state_leaves() -> None:
    tx = make(lambda u, s, p=None: (u, s), lambda p: {"count": 0})
    with pytest.raises(AssertionError, match=r"state after init has leaf 'count' = a int; "
                                             r"state leaves must be tensors or None"):
        conformance.check_layout(tx, PARAMS, GRADS)


class _Opaque:
    def __init__(self, value: int) -> None:
        self.value = value


def test_roundtrip_rejects_unloadable_state() -> None:
    tx = make(lambda u, s, p=None: (u, s), lambda p: {"obj": _Opaque(1)})
    with pytest.raises(AssertionError, match=r"check_state_roundtrip: torch.load\(weights_only"
                                             r"=True\) fails on the state after init"):
        conformance.check_state_roundtrip(tx, PARAMS, GRADS)
    tx = make(lambda u, s, p=None: (u, s), lambda p: {"fn": lambda: 0})
    with pytest.raises(AssertionError, match=r"torch.save fails on the state after init"):
        conformance.check_state_roundtrip(tx, PARAMS, GRADS)


def test_roundtrip_catches_state_that_does_not_resume() -> None:
    # The update keys its result on the identity of a state tensor, which a load changes.
    seen: dict[int, torch.Tensor] = {}

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        factor = 1.0 if id(state["m"]) in seen else 2.0
        seen[id(state["m"])] = state["m"]
        return {k: None if g is None else g * factor for k, g in updates.items()}, state

    state0 = {"m": torch.zeros(())}
    seen[id(state0["m"])] = state0["m"]
    tx = make(update, lambda p: state0)
    with pytest.raises(AssertionError, match=r"updates of step 1 from the loaded vs the saved "
                                             r"state: leaf 'b'"):
        conformance.check_state_roundtrip(tx, PARAMS, GRADS)


def test_roundtrip_loads_namedtuple_states_with_weights_only() -> None:
    tx = functopt.scale_by_adam()
    state = tx.init(PARAMS)
    assert conformance._namedtuple_classes((state, {"x": [state]})) == [functopt.ScaleByAdamState]
    conformance.check_state_roundtrip(lambda: tx, PARAMS, GRADS, steps=3)


class _UserState(NamedTuple):  # a state class of a user's own rule
    mu: torch.Tensor


def test_weights_only_load_needs_a_user_state_class_allowlisted() -> None:
    # What check_state_roundtrip relies on, and what its docstring tells users to do: the
    # import of functopt allows functopt's own classes only.
    state = (_UserState(torch.ones(2)), functopt.scale_by_adam().init(PARAMS))
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    with pytest.raises(pickle.UnpicklingError, match="_UserState"):
        torch.load(buffer, weights_only=True)
    buffer.seek(0)
    with torch.serialization.safe_globals([_UserState]):
        loaded = torch.load(buffer, weights_only=True)
    assert type(loaded[0]) is _UserState and type(loaded[1]) is functopt.ScaleByAdamState
    _compare.assert_trees_equal(loaded, state, check="c", what="w")


def test_chain_laws_catch_a_call_counting_transform() -> None:
    counter = [0]

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        counter[0] += 1
        return {k: None if g is None else g + counter[0] for k, g in updates.items()}, state

    tx = functopt.GradientTransformation(lambda p: (), update)
    with pytest.raises(AssertionError, match=r"check_chain_laws: chain\(a, chain\(b, c\)\) vs "
                                             r"chain\(a, b, c\): updates of step 1: leaf 'b'"):
        conformance.check_chain_laws(tx, tx, tx, PARAMS, GRADS)


def test_chain_laws_hold_for_different_transforms() -> None:
    conformance.check_chain_laws(lambda: functopt.scale_by_adam(), lambda: functopt.scale(-2.0),
                                 lambda: functopt.scale_by_schedule(lambda c: c + 1), PARAMS,
                                 GRADS, steps=3)


def test_masked_check_catches_a_wrong_masked(monkeypatch: pytest.MonkeyPatch) -> None:
    def unmasked(inner: Any, mask: Any) -> Any:  # ignores the mask: applies inner everywhere
        return inner

    tx = lambda: functopt.scale(-1.0)  # noqa: E731
    conformance.check_masked_equals_per_leaf(tx, PARAMS, GRADS)
    monkeypatch.setattr(functopt, "masked", unmasked)
    with pytest.raises(AssertionError, match=r"check_masked_equals_per_leaf: step 1, leaf 'n|w':"
                                             r" masked\(tx\) gave something other than the "
                                             r"incoming gradient \(leaf not selected\)"):
        conformance.check_masked_equals_per_leaf(tx, PARAMS, GRADS,
                                                 mask={"w": False, "b": True, "n": True})


def test_duck_typed_transforms_and_factories_are_accepted() -> None:
    class Doubler:
        def init(self, params: Any) -> Any:
            return ()

        def update(self, updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
            return double_tree(updates, params), state

    conformance.check_transform(Doubler(), PARAMS, GRADS)
    conformance.check_transform(Doubler, PARAMS, GRADS)  # the class is a factory


def test_bad_arguments_are_reported() -> None:
    with pytest.raises(TypeError, match=r"check_purity: expected a GradientTransformation or a "
                                        r"zero-argument factory returning one, got int"):
        conformance.check_purity(3, PARAMS, GRADS)
    with pytest.raises(TypeError, match=r"the factory returned float, not a "
                                        r"GradientTransformation"):
        conformance.check_layout(lambda: 1.0, PARAMS, GRADS)
    with pytest.raises(ValueError, match=r"unknown check names in skip: \['purty'\]"):
        conformance.check_transform(functopt.identity(), PARAMS, GRADS, skip=["purty"])


def test_skip_skips() -> None:
    tx = make(map_grads(lambda g: g.mul_(1)))  # impure, but purity is skipped
    conformance.check_transform(tx, PARAMS, {"w": torch.ones(3), "b": None, "n": None},
                                skip=["purity", "determinism", "chain_laws", "masked"])


def test_comparison_is_nan_and_signed_zero_aware() -> None:
    nan = torch.tensor([float("nan"), 1.0])
    _compare.assert_trees_equal({"x": nan}, {"x": nan.clone()}, check="c", what="w")
    with pytest.raises(AssertionError, match=r"c: w: leaf 'x': 1 of 1 elements differ bitwise; "
                                             r"first at index \(\): -0.0 vs 0.0"):
        _compare.assert_trees_equal({"x": torch.tensor(-0.0)}, {"x": torch.tensor(0.0)},
                                        check="c", what="w")
    with pytest.raises(AssertionError, match=r"first at index \(1, 0\): \(1\+2j\) vs 0j"):
        a = torch.zeros(2, 1, dtype=torch.complex64)
        b = a.clone()
        a[1, 0] = 1 + 2j
        _compare.assert_trees_equal([a], [b], check="c", what="w")


# --- the hypothesis entry point ------------------------------------------------------------

test_conformance_test_entry_point = conformance.conformance_test(
    lambda: functopt.chain(functopt.scale_by_adam(), functopt.scale(-0.1)), max_examples=5)


def test_conformance_test_fails_on_a_broken_transform() -> None:
    def add_zero_in_place(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        return optree.tree_map(lambda g: None if g is None else g.add_(0), updates,
                               none_is_leaf=True, namespace=_core.NAMESPACE), state

    test = conformance.conformance_test(
        lambda: functopt.GradientTransformation(lambda p: (), add_zero_in_place),
        max_examples=20, dtypes=(torch.float32,), allow_none=False,
        hypothesis_settings=settings(phases=[Phase.explicit, Phase.generate]))
    assert test.__name__.startswith("conformance_test_")
    with pytest.raises(AssertionError, match=r"check_purity: update \(step 1\) mutated leaf"):
        test()


def test_conformance_test_passes_options_through() -> None:
    seen: list[Any] = []

    def factory() -> Any:
        def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any, Any]:
            seen.append((params is None, extra))
            return updates, state

        return functopt.GradientTransformation(lambda p: (), update)

    conformance.conformance_test(factory, max_examples=2, with_params=False,
                                 extra_args={"loss": 1.0}, skip=conformance.CHECKS[1:])()
    assert seen and all(s == (True, {"loss": 1.0}) for s in seen)
