"""The laws every functopt transform obeys, as checks you can run on your own transforms.

Each ``check_*`` function takes a transform (or a zero-argument factory returning one) and
concrete ``params`` and ``grads``, runs the transform, and raises ``AssertionError`` with a
message that names the check, the call, the tree and the leaf path where a law failed. They
are plain functions, so they can be called from inside your own ``@given`` tests;
`conformance_test` builds such a hypothesis test for you.

The laws:

- **purity** (`check_purity`): ``init`` and ``update`` never mutate their inputs, nor
  anything they returned earlier (values compared bitwise, NaN included; in-place ops are
  caught by the tensors' version counters even when they leave the values as they were;
  dicts and lists of the trees must not be edited either). Returning an input object
  unchanged (as ``identity`` does) is allowed: purity is about mutation, not aliasing.
- **determinism** (`check_determinism`): the same inputs give bitwise the same
  updates and states, run after run, with one transform object and with fresh ones.
- **layout** (`check_layout`): updates have the gradients' structure, and leaf by leaf
  their shape, dtype and device; a ``None`` gradient gives a ``None`` update; the state's
  structure, dtypes, shapes and devices after each update are those after ``init``; state
  leaves are tensors or ``None``.
- **state round trip** (`check_state_roundtrip`): the state survives an in-memory
  ``torch.save`` / ``torch.load(weights_only=True)``, and continuing from the loaded state
  gives bitwise the next update and state.
- **chain laws** (`check_chain_laws`): ``chain(a, chain(b, c))`` updates as
  ``chain(a, b, c)`` does; ``identity()`` is neutral on either side.
- **masking** (`check_masked_equals_per_leaf`): ``masked(tx, mask)`` gives, on the
  selected leaves, what ``tx`` gives on the tree restricted to them (``None`` elsewhere),
  and leaves the other updates as they were.
- **fast path** (`check_fast_path`): ``functopt.fast.make_step(tx)``, donated or not,
  equals the pure step (``update`` then ``apply_updates``) from the same inputs: bitwise
  where the planner keeps the pure path, to rounding where it lowers the step to fused
  kernels (a relative $10^{-12}$ in float64, a few units in the last place of each leaf's
  magnitude in the narrow dtypes, non-finite exactly where the pure path is); without
  donation it writes into nothing; donated, it refuses tied params (one tensor at two
  places of the tree) with a ValueError naming them. `cases` draws the layouts fast paths
  get wrong (channels_last, transposed, sliced, grads laid out unlike their params, 0-d
  and empty leaves, tied params).
- **capture** (`check_capture`): ``step.capture`` of the donated step, replayed once per
  gradient tree, equals the step run as it is recorded (bitwise) and the pure step (the
  tolerance above); recording changes no value; tied params and params without a
  gradient are refused by name. On a CPU it records a tape of the step's operations,
  which refuses host reads as a CUDA graph does.

About ``weights_only=True``: PyTorch's safe unpickler rejects classes it does not know,
and a NamedTuple state is such a class. ``import functopt`` allows functopt's own state
classes; a state class of a user's rule loads once it is allowlisted
(`check_state_roundtrip` allows the classes it finds in the state for its own load)::

    torch.serialization.add_safe_globals([MyRuleState])

(``weights_only=False`` also works, but runs arbitrary code from the file.) The check
allowlists exactly the NamedTuple classes found in the state, so a state holding anything
else (a function, an arbitrary object) fails it.

Examples:
    >>> import torch, functopt
    >>> from functopt.testing import conformance
    >>> params = {"w": torch.ones(3), "b": torch.zeros(())}
    >>> grads = {"w": torch.tensor([0.5, float("nan"), -1.0]), "b": None}
    >>> conformance.check_transform(lambda: functopt.scale_by_adam(), params, grads)
    >>> def bad():  # doubles the gradients in place
    ...     def update(updates, state, params=None):
    ...         return {k: None if g is None else g.mul_(2) for k, g in updates.items()}, state
    ...     return functopt.GradientTransformation(lambda p: (), update)
    >>> conformance.check_purity(bad, params, grads)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    AssertionError: check_purity: update (step 1) mutated leaf 'w' of grads in place...
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import functopt
from functopt import _serialization
from functopt._base import GradientTransformation
from functopt.testing import _compare
from functopt.testing import strategies as fst
from functopt.testing._fast import (
    FAST_PATH_REL_FLOAT64,
    FAST_PATH_ULPS,
    check_capture,
    check_fast_path,
)
from functopt.testing._running import TransformOrFactory, build, is_transform, run_steps
from functopt.tree import _core

__all__ = ["CHECKS", "FAST_PATH_REL_FLOAT64", "FAST_PATH_ULPS", "TransformOrFactory", "cases",
           "check_capture", "check_chain_laws", "check_determinism", "check_fast_path",
           "check_layout", "check_masked_equals_per_leaf", "check_purity", "check_state_roundtrip",
           "check_transform", "conformance_test"]

CHECKS: tuple[str, ...] = ("purity", "determinism", "layout", "state_roundtrip", "chain_laws",
                           "masked", "fast_path")
"""Names of the checks `check_transform` runs (and accepts in ``skip``)."""

# --- purity --------------------------------------------------------------------------------


def check_purity(
    tx: TransformOrFactory, params: Any, grads: Any, steps: int = 2, *,
    with_params: bool = True, extra_args: Mapping[str, Any] | None = None,
) -> None:
    """Check that ``init`` and ``update`` mutate nothing they are given or gave back.

    Runs ``init(params)`` and ``steps`` updates on ``grads``. After each call, every tree
    seen so far (params, grads, the states and updates of earlier calls) must be as it was:
    the same containers holding the same leaf objects, bitwise the same values (NaN-aware),
    and unmoved version counters (so an in-place op is caught even when it writes the same
    values, as ``x.mul_(1)`` does).

    Args:
        tx: the transform, or a zero-argument factory building it.
        params: the params (passed to ``init``, and to ``update`` if ``with_params``).
        grads: the gradients, with the params' structure (``None`` leaves allowed).
        steps: how many updates to run.
        with_params: pass the params to ``update`` (set False to check the no-params path).
        extra_args: keyword arguments passed to every ``update``.

    Raises:
        AssertionError: naming the call, the tree and the leaf that was mutated.

    Examples:
        >>> import torch, functopt
        >>> from functopt.testing import conformance
        >>> params = {"w": torch.ones(3), "b": torch.zeros(2, dtype=torch.bfloat16)}
        >>> grads = {"w": torch.tensor([0.5, -1.0, 2.0]), "b": None}
        >>> conformance.check_purity(lambda: functopt.adam(0.1), params, grads)  # returns None when the law holds
    """
    tx = build(tx, "check_purity")
    snapshot = _compare.Snapshot()
    snapshot.add("params", params)
    snapshot.add("grads", grads)
    state = tx.init(params)
    snapshot.verify("init")
    snapshot.add("the state returned by init", state)
    for step in range(1, steps + 1):
        updates, state = tx.update(grads, state, params if with_params else None,
                                   **(extra_args or {}))
        snapshot.verify(f"update (step {step})")
        snapshot.add(f"the updates of step {step}", updates)
        snapshot.add(f"the state returned by step {step}", state)


# --- determinism ---------------------------------------------------------------------------


def check_determinism(
    tx: TransformOrFactory, params: Any, grads: Any, steps: int = 2, *,
    with_params: bool = True, extra_args: Mapping[str, Any] | None = None,
) -> None:
    """Check that two runs give bitwise the same states and updates.

    The same transform object runs twice (catching state hidden in its closure); given a
    factory, a freshly built transform runs a third time (catching global state).

    Raises:
        AssertionError: naming the run, the step, the tree and the leaf that differed.

    Examples:
        >>> import torch, functopt
        >>> from functopt.testing import conformance
        >>> params = {"w": torch.ones(3), "b": torch.zeros(2, dtype=torch.bfloat16)}
        >>> grads = {"w": torch.tensor([0.5, -1.0, 2.0]), "b": None}
        >>> conformance.check_determinism(lambda: functopt.adam(0.1), params, grads)  # returns None when the law holds
    """
    check = "check_determinism"
    first = build(tx, check)
    runs = [("a second run of the same transform", first)]
    if not is_transform(tx):
        runs.append(("a run of a freshly built transform", build(tx, check)))
    ref_state0, ref = run_steps(first, params, grads, steps, with_params, extra_args)
    fix = (" Fix: keep everything that changes between steps in the state (no Python-side "
           "counters in closures, no unseeded randomness).")
    for label, other in runs:
        state0, out = run_steps(other, params, grads, steps, with_params, extra_args)
        _compare.assert_trees_equal(state0, ref_state0, check=check,
                            what=f"init state of {label} vs the first run", fix=fix)
        for step, ((u, s), (ref_u, ref_s)) in enumerate(zip(out, ref, strict=True), 1):
            _compare.assert_trees_equal(u, ref_u, check=check,
                                what=f"updates of step {step} of {label} vs the first run",
                                fix=fix)
            _compare.assert_trees_equal(s, ref_s, check=check,
                                what=f"state after step {step} of {label} vs the first run",
                                fix=fix)


# --- layout --------------------------------------------------------------------------------


def _check_state_leaves(state: Any, when: str) -> None:
    leaves, spec = _core.flatten(state)
    for path, leaf in zip(_core.paths(spec), leaves, strict=True):
        if leaf is not None and not isinstance(leaf, torch.Tensor):
            raise AssertionError(
                f"check_layout: the state {when} has leaf {path!r} = {_core._describe(leaf)}; "
                f"state leaves must be tensors or None (so that states checkpoint, move "
                f"between devices and work under torch.func). Fix: store it as a 0-d tensor, "
                f"or keep constants in the transform's closure."
            )


def _assert_same_layout(actual: Any, reference: Any, *, what: str, fix: str) -> None:
    a_leaves, a_spec = _core.flatten(actual)
    r_leaves, r_spec = _core.flatten(reference)
    if a_spec != r_spec:
        where = _core._first_difference(reference, actual, "<root>")
        raise AssertionError(f"check_layout: {what}: different structures ({where}).{fix}")
    for path, a, r in zip(_core.paths(r_spec), a_leaves, r_leaves, strict=True):
        if (a is None) != (r is None):
            raise AssertionError(
                f"check_layout: {what}: leaf {path!r} is {_core._describe(a)}, expected "
                f"{_core._describe(r)}.{fix}"
            )
        if isinstance(a, torch.Tensor) and isinstance(r, torch.Tensor):
            for attribute in ("shape", "dtype", "device"):
                got, expected = getattr(a, attribute), getattr(r, attribute)
                if got != expected:
                    raise AssertionError(
                        f"check_layout: {what}: leaf {path!r} has {attribute} {got}, expected "
                        f"{expected}.{fix}"
                    )


def check_layout(
    tx: TransformOrFactory, params: Any, grads: Any, steps: int = 2, *,
    with_params: bool = True, extra_args: Mapping[str, Any] | None = None,
) -> None:
    """Check the layout of updates and states.

    Updates must have the gradients' structure, and leaf by leaf their shape, dtype and
    device (``None`` where the gradient is ``None``). The state after every update must have
    the structure, shapes, dtypes and devices of the state after ``init``, and its leaves
    must be tensors or ``None``.

    Raises:
        AssertionError: naming the step, the tree, the leaf and the attribute that differed.

    Examples:
        >>> import torch, functopt
        >>> from functopt.testing import conformance
        >>> params = {"w": torch.ones(3), "b": torch.zeros(2, dtype=torch.bfloat16)}
        >>> grads = {"w": torch.tensor([0.5, -1.0, 2.0]), "b": None}
        >>> conformance.check_layout(lambda: functopt.adam(0.1), params, grads)  # returns None when the law holds
    """
    tx = build(tx, "check_layout")
    state0, out = run_steps(tx, params, grads, steps, with_params, extra_args)
    _check_state_leaves(state0, "after init")
    for step, (updates, state) in enumerate(out, 1):
        _assert_same_layout(
            updates, grads, what=f"updates of step {step} vs the grads",
            fix=" Fix: return one update per gradient, of its shape, dtype and device (cast "
                "back with .to(g.dtype) after computing in a wider dtype), and None where the "
                "gradient is None.",
        )
        _check_state_leaves(state, f"after step {step}")
        _assert_same_layout(
            state, state0, what=f"state after step {step} vs the state after init",
            fix=" Fix: init must build every state leaf with its final shape and dtype, so "
                "the state keeps one layout (checkpoints and compiled steps depend on it).",
        )


# --- state round trip ----------------------------------------------------------------------


def _namedtuple_classes(tree: Any, found: dict[str, type] | None = None) -> list[type]:
    """The NamedTuple classes in ``tree``: what ``torch.load(weights_only=True)`` must allow."""
    found = {} if found is None else found
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        found[f"{type(tree).__module__}.{type(tree).__qualname__}"] = type(tree)
    if isinstance(tree, (list, tuple)):
        for child in tree:
            _namedtuple_classes(child, found)
    elif isinstance(tree, dict):
        for child in tree.values():
            _namedtuple_classes(child, found)
    return list(found.values())


def _save_load(state: Any, when: str) -> Any:
    buffer = io.BytesIO()
    try:
        torch.save(state, buffer)
    except Exception as err:
        raise AssertionError(
            f"check_state_roundtrip: torch.save fails on the state {when}: "
            f"{type(err).__name__}: {err}. Fix: keep the state a pytree of tensors in "
            f"NamedTuples, dicts, lists and tuples (no functions or other objects)."
        ) from err
    buffer.seek(0)
    classes = _namedtuple_classes(state)
    try:
        with _serialization.allowing(classes):
            return torch.load(buffer, weights_only=True)
    except Exception as err:
        names = [c.__qualname__ for c in classes]
        raise AssertionError(
            f"check_state_roundtrip: torch.load(weights_only=True) fails on the state {when}, "
            f"with its NamedTuple classes {names} allowlisted: {type(err).__name__}: "
            f"{str(err).strip().splitlines()[-1] if str(err).strip() else ''}. Fix: keep the "
            f"state a pytree of tensors in NamedTuples, dicts, lists and tuples."
        ) from err


def check_state_roundtrip(
    tx: TransformOrFactory, params: Any, grads: Any, steps: int = 2, *,
    with_params: bool = True, extra_args: Mapping[str, Any] | None = None,
) -> None:
    """Check that states survive ``torch.save``/``torch.load`` and resume bitwise.

    After ``init`` and after each of the first ``steps - 1`` updates, the state is saved to
    memory and loaded back with ``weights_only=True`` (its NamedTuple classes allowlisted
    with ``torch.serialization.safe_globals``). The loaded state must equal the original
    bitwise, and one update from each must give bitwise the same updates and state.

    Raises:
        AssertionError: naming the step and the leaf, or the save/load error.

    Examples:
        >>> import torch, functopt
        >>> from functopt.testing import conformance
        >>> params = {"w": torch.ones(3), "b": torch.zeros(2, dtype=torch.bfloat16)}
        >>> grads = {"w": torch.tensor([0.5, -1.0, 2.0]), "b": None}
        >>> conformance.check_state_roundtrip(lambda: functopt.adam(0.1), params, grads)  # returns None when the law holds
    """
    check = "check_state_roundtrip"
    tx = build(tx, check)
    state = tx.init(params)
    call_params = params if with_params else None
    for step in range(steps):
        when = "after init" if step == 0 else f"after step {step}"
        loaded = _save_load(state, when)
        _compare.assert_trees_equal(loaded, state, check=check,
                            what=f"loaded vs saved state ({when})")
        updates, new_state = tx.update(grads, state, call_params, **(extra_args or {}))
        updates_l, new_state_l = tx.update(grads, loaded, call_params, **(extra_args or {}))
        _compare.assert_trees_equal(updates_l, updates, check=check,
                            what=f"updates of step {step + 1} from the loaded vs the saved state")
        _compare.assert_trees_equal(new_state_l, new_state, check=check,
                            what=f"state after step {step + 1} from the loaded vs the saved "
                                 f"state")
        state = new_state


# --- chain laws ----------------------------------------------------------------------------


def check_chain_laws(
    tx_a: TransformOrFactory, tx_b: TransformOrFactory, tx_c: TransformOrFactory,
    params: Any, grads: Any, steps: int = 2, *,
    with_params: bool = True, extra_args: Mapping[str, Any] | None = None,
) -> None:
    """Check associativity of ``chain`` and the neutrality of ``identity()``.

    Over ``steps`` updates: ``chain(a, chain(b, c))`` gives bitwise the updates of
    ``chain(a, b, c)``, and the same state leaves (only the nesting of the state tuple
    differs); ``chain(identity(), a)`` and ``chain(a, identity())`` give bitwise the updates
    and the state of ``a``.

    Raises:
        AssertionError: naming the law, the step and the leaf that differed.

    Examples:
        >>> import torch, functopt
        >>> from functopt.testing import conformance
        >>> params = {"w": torch.ones(3), "b": torch.zeros(2, dtype=torch.bfloat16)}
        >>> grads = {"w": torch.tensor([0.5, -1.0, 2.0]), "b": None}
        >>> conformance.check_chain_laws(
        ...     lambda: functopt.clip(1.0), functopt.scale_by_adam, lambda: functopt.scale(-0.1),
        ...     params, grads)  # returns None when the law holds
    """
    check = "check_chain_laws"

    def fresh(tx: TransformOrFactory) -> GradientTransformation:
        return build(tx, check)

    def run(tx: GradientTransformation) -> list[tuple[Any, Any]]:
        return run_steps(tx, params, grads, steps, with_params, extra_args)[1]

    nested = run(functopt.chain(fresh(tx_a), functopt.chain(fresh(tx_b), fresh(tx_c))))
    flat = run(functopt.chain(fresh(tx_a), fresh(tx_b), fresh(tx_c)))
    for step, ((u_n, s_n), (u_f, s_f)) in enumerate(zip(nested, flat, strict=True), 1):
        law = "chain(a, chain(b, c)) vs chain(a, b, c)"
        _compare.assert_trees_equal(u_n, u_f, check=check, what=f"{law}: updates of step {step}")
        _compare.assert_trees_equal((s_n[0], *s_n[1]), s_f, check=check,
                            what=f"{law}: state after step {step} (nesting removed)")
    alone = run(fresh(tx_a))
    for law, tx, pick in (
        ("chain(identity(), a) vs a", functopt.chain(functopt.identity(), fresh(tx_a)), 1),
        ("chain(a, identity()) vs a", functopt.chain(fresh(tx_a), functopt.identity()), 0),
    ):
        for step, ((u, s), (u_a, s_a)) in enumerate(zip(run(tx), alone, strict=True), 1):
            _compare.assert_trees_equal(u, u_a, check=check, what=f"{law}: updates of step {step}")
            _compare.assert_trees_equal(s[pick], s_a, check=check,
                                what=f"{law}: state of a after step {step}")


# --- masking -------------------------------------------------------------------------------


def _default_mask(params: Any) -> Any:
    """Select every other leaf of the params, starting with the first."""
    leaves, spec = _core.flatten(params)
    return _core.unflatten(spec, [i % 2 == 0 for i in range(len(leaves))])


def check_masked_equals_per_leaf(
    tx: TransformOrFactory, params: Any, grads: Any, mask: Any = None, steps: int = 2, *,
    with_params: bool = True, extra_args: Mapping[str, Any] | None = None,
) -> None:
    """Check that ``functopt.masked(tx, mask)`` is ``tx`` on the selected leaves only.

    Over ``steps`` updates, ``masked(tx, mask)`` on the full trees must give, on every leaf
    that ``mask`` selects, bitwise what ``tx`` gives on the trees restricted to the selected
    leaves (params and grads replaced by ``None`` elsewhere), and must return the other
    updates bitwise as they came in.

    Args:
        mask: a pytree of bools with the params' structure; by default every other leaf.

    Raises:
        AssertionError: naming the step, the leaf and what differed.

    Examples:
        >>> import torch, functopt
        >>> from functopt.testing import conformance
        >>> params = {"w": torch.ones(3), "b": torch.zeros(2, dtype=torch.bfloat16)}
        >>> grads = {"w": torch.tensor([0.5, -1.0, 2.0]), "b": None}
        >>> conformance.check_masked_equals_per_leaf(
        ...     lambda: functopt.adam(0.1), params, grads, mask={"w": True, "b": False})  # returns None when the law holds
    """
    check = "check_masked_equals_per_leaf"
    if mask is None:
        mask = _default_mask(params)
    param_leaves, spec = _core.flatten(params)
    selected = [bool(m) for m in _core.flatten_like(spec, mask, name="mask", reference="params")]
    grad_leaves = _core.flatten_like(spec, grads, name="grads", reference="params")
    restricted_params = _core.unflatten(
        spec, [p if s else None for p, s in zip(param_leaves, selected, strict=True)])
    restricted_grads = _core.unflatten(
        spec, [g if s else None for g, s in zip(grad_leaves, selected, strict=True)])

    masked_out = run_steps(functopt.masked(build(tx, check), mask), params, grads, steps,
                      with_params, extra_args)[1]
    reference = run_steps(build(tx, check), restricted_params, restricted_grads, steps, with_params,
                     extra_args)[1]
    paths = _core.paths(spec)
    for step, ((u_m, _), (u_r, _)) in enumerate(zip(masked_out, reference, strict=True), 1):
        got = _core.flatten_like(spec, u_m, name="masked updates", reference="params")
        want = _core.flatten_like(spec, u_r, name="updates", reference="params")
        for path, is_selected, g, m, r in zip(paths, selected, grad_leaves, got, want,
                                              strict=True):
            expected, source = (r, "tx on the restricted tree") if is_selected else (
                g, "the incoming gradient (leaf not selected)")
            difference = _compare.leaf_difference(m, expected)
            if difference is not None:
                raise AssertionError(
                    f"{check}: step {step}, leaf {path!r}: masked(tx) gave something other "
                    f"than {source}: {difference} (masked vs expected)."
                )


# --- all together --------------------------------------------------------------------------


def check_transform(
    tx: TransformOrFactory, params: Any, grads: Any, *, steps: int = 2, mask: Any = None,
    with_params: bool = True, extra_args: Mapping[str, Any] | None = None,
    skip: Collection[str] = (),
) -> None:
    """Run every conformance check on one transform (see `CHECKS`).

    The chain laws are checked with ``a = b = c = tx``.

    Args:
        tx: the transform, or (better) a zero-argument factory building it.
        params: a concrete tree of params.
        grads: a tree of gradients like ``params`` (``None`` leaves allowed).
        steps: updates per run.
        mask: the mask for the masking law (default: every other leaf).
        with_params: pass the params to ``update``.
        extra_args: keyword arguments for every ``update``.
        skip: names from `CHECKS` not to run.

    Raises:
        AssertionError: from the first check that fails.

    Examples:
        >>> import torch, functopt
        >>> from functopt.testing import conformance
        >>> params = {"w": torch.ones(3), "b": torch.zeros(2, dtype=torch.bfloat16)}
        >>> grads = {"w": torch.tensor([0.5, -1.0, 2.0]), "b": None}
        >>> conformance.check_transform(lambda: functopt.adam(0.1), params, grads)  # all checks pass
        >>> bad = functopt.GradientTransformation(
        ...     lambda p: (), lambda u, s, p=None: ({k: None for k in u}, s))
        >>> try:
        ...     conformance.check_transform(bad, params, grads, skip=("masked", "chain_laws"))
        ... except AssertionError:
        ...     print("caught")
        caught
    """
    unknown = sorted(set(skip) - set(CHECKS))
    if unknown:
        raise ValueError(f"check_transform: unknown check names in skip: {unknown}; the "
                         f"checks are {list(CHECKS)}.")
    kw: dict[str, Any] = {"with_params": with_params, "extra_args": extra_args}
    if "purity" not in skip:
        check_purity(tx, params, grads, steps, **kw)
    if "determinism" not in skip:
        check_determinism(tx, params, grads, steps, **kw)
    if "layout" not in skip:
        check_layout(tx, params, grads, steps, **kw)
    if "state_roundtrip" not in skip:
        check_state_roundtrip(tx, params, grads, steps, **kw)
    if "chain_laws" not in skip:
        check_chain_laws(tx, tx, tx, params, grads, steps, **kw)
    if "masked" not in skip:
        check_masked_equals_per_leaf(tx, params, grads, mask, steps, **kw)
    if "fast_path" not in skip:
        check_fast_path(tx, params, grads, steps, **kw)


@st.composite
def cases(
    draw: st.DrawFn, *, dtypes: tuple[torch.dtype, ...] = fst.FLOAT_DTYPES,
    param_kind: fst.ValueKind = "typical", grad_kind: fst.ValueKind = "any",
    allow_none: bool = True, max_leaves: int = 6, layout: fst.LayoutChoice = "any",
    tied: bool = True,
) -> tuple[Any, Any, Any]:
    """``(params, grads, mask)`` for the checks: a mask of Python bools drawn over the params.

    The other arguments are those of [`functopt.testing.strategies.params_and_gradients`][functopt.testing.strategies.params_and_gradients];
    by default every layout is drawn (channels_last, transposed and sliced leaves, grads
    laid out unlike their params) and some params are tied (one tensor at two places).

    Examples:
        >>> import functopt
        >>> from hypothesis import given, settings
        >>> from functopt.testing import conformance
        >>> @settings(max_examples=5)
        ... @given(conformance.cases(max_leaves=3))
        ... def check(case):
        ...     params, grads, mask = case
        ...     assert functopt.tree.structure(mask) == functopt.tree.structure(params)
        >>> check()
    """
    params, grads = draw(fst.params_and_gradients(
        dtypes=dtypes, param_kind=param_kind, grad_kind=grad_kind, max_leaves=max_leaves,
        allow_none=allow_none, layout=layout, tied=tied))
    leaves, spec = _core.flatten(params)
    mask = _core.unflatten(spec, draw(st.lists(st.booleans(), min_size=len(leaves),
                                               max_size=len(leaves))))
    return params, grads, mask


def conformance_test(
    tx_factory: Callable[[], GradientTransformation], *,
    dtypes: tuple[torch.dtype, ...] = fst.FLOAT_DTYPES,
    grad_kind: fst.ValueKind = "any",
    param_kind: fst.ValueKind = "typical",
    allow_none: bool = True,
    max_leaves: int = 6,
    layout: fst.LayoutChoice = "any",
    tied: bool = True,
    max_examples: int | None = None,
    hypothesis_settings: settings | None = None,
    steps: int = 2,
    with_params: bool = True,
    extra_args: Mapping[str, Any] | None = None,
    skip: Collection[str] = (),
) -> Callable[[], None]:
    """A hypothesis test running `check_transform` on drawn params, grads and masks.

    Assign it in a test module and pytest collects it::

        test_my_transform = conformance_test(lambda: my_transform(0.1))

    Args:
        tx_factory: a zero-argument function building the transform.
        dtypes: the floating dtypes the param leaves are drawn from.
        grad_kind: ``"typical"``, ``"finite"`` or ``"any"`` (with inf and nan).
        param_kind: the kind of param values.
        allow_none: let some gradient leaves be ``None``.
        max_leaves: the largest number of leaves in a drawn tree.
        layout: the leaves' memory layouts (``"any"``: drawn per leaf, grads apart from
            their params; see [`functopt.testing.strategies.laid_out`][functopt.testing.strategies.laid_out]).
        tied: let some trees hold one param tensor at two places.
        max_examples: the number of examples (default: that of ``hypothesis_settings``).
        hypothesis_settings: the settings to run under (default: the active profile's,
            without a deadline and without the too_slow and data_too_large health checks).
        steps: as for `check_transform`.
        with_params: as for `check_transform`.
        extra_args: as for `check_transform`.
        skip: as for `check_transform`.

    Returns:
        A zero-argument test function.

    Examples:
        >>> import functopt
        >>> from functopt.testing import conformance
        >>> test_adam = conformance.conformance_test(lambda: functopt.adam(0.1), max_examples=3)
        >>> test_adam()  # what pytest runs: hypothesis draws 3 cases, every check passes
    """
    strategy = cases(dtypes=tuple(dtypes), param_kind=param_kind, grad_kind=grad_kind,
                      allow_none=allow_none, max_leaves=max_leaves, layout=layout, tied=tied)

    def test(case: tuple[Any, Any, Any]) -> None:
        params, grads, mask = case
        check_transform(tx_factory, params, grads, steps=steps, mask=mask,
                        with_params=with_params, extra_args=extra_args, skip=skip)

    # Hypothesis keys its example database by the test's name: give each test its own.
    label = getattr(tx_factory, "__qualname__", type(tx_factory).__name__)
    test.__name__ = test.__qualname__ = "conformance_test_" + re.sub(r"\W+", "_", label)
    wrapped = given(case=strategy)(test)
    if hypothesis_settings is None:
        # Drawing tensors and running every check is slower than hypothesis expects of a
        # test by default; a deadline would make the test flaky on a busy machine.
        suppressed = set(settings().suppress_health_check)
        suppressed |= {HealthCheck.too_slow, HealthCheck.data_too_large}
        hypothesis_settings = settings(deadline=None, suppress_health_check=sorted(
            suppressed, key=lambda h: h.value))
    if max_examples is not None:
        hypothesis_settings = settings(hypothesis_settings, max_examples=max_examples)
    return hypothesis_settings(wrapped)
