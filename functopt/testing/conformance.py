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
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import optree
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import functopt
from functopt import _serialization
from functopt._base import GradientTransformation
from functopt.fast import FastPathWarning, _capture, explain, make_step
from functopt.testing import _compare
from functopt.testing import strategies as fst
from functopt.tree import _core

__all__ = [
    "CHECKS",
    "TransformOrFactory",
    "cases",
    "check_capture",
    "check_chain_laws",
    "check_determinism",
    "check_fast_path",
    "check_layout",
    "check_masked_equals_per_leaf",
    "check_purity",
    "check_state_roundtrip",
    "check_transform",
    "conformance_test",
]

TransformOrFactory = GradientTransformation | Callable[[], GradientTransformation]
"""A transform, or a zero-argument function that builds one (``lambda: functopt.adam(1e-3)``).

Give a factory where you can: checks that compare runs build a fresh transform per run."""

CHECKS: tuple[str, ...] = ("purity", "determinism", "layout", "state_roundtrip", "chain_laws",
                           "masked", "fast_path")
"""Names of the checks `check_transform` runs (and accepts in ``skip``)."""

# --- building and running ------------------------------------------------------------------


def _build(tx: Any, owner: str) -> GradientTransformation:
    """The transform itself, or what the factory returns (duck-typed ``init``/``update``)."""
    if not _is_transform(tx):
        if not callable(tx):
            raise TypeError(
                f"{owner}: expected a GradientTransformation or a zero-argument factory "
                f"returning one, got {type(tx).__name__}."
            )
        tx = tx()
        if not _is_transform(tx):
            raise TypeError(
                f"{owner}: the factory returned {type(tx).__name__}, not a "
                f"GradientTransformation. Fix: pass `lambda: my_transform(...)`."
            )
    if isinstance(tx, GradientTransformation):
        return tx
    if isinstance(tx, functopt.MultiSteps):  # (its spec comes with gradient_transformation)
        return tx.gradient_transformation()
    return GradientTransformation(tx.init, tx.update)


def _is_transform(tx: Any) -> bool:
    return isinstance(tx, GradientTransformation) or (
        not isinstance(tx, type) and callable(getattr(tx, "init", None))
        and callable(getattr(tx, "update", None))
    )


def _run(
    tx: GradientTransformation, params: Any, grads: Any, steps: int, with_params: bool,
    extra_args: Mapping[str, Any] | None,
) -> tuple[Any, list[tuple[Any, Any]]]:
    """``init`` then ``steps`` updates on the same grads: ``(state0, [(updates, state), ...])``."""
    state = tx.init(params)
    state0 = state
    out = []
    for _ in range(steps):
        updates, state = tx.update(grads, state, params if with_params else None,
                                   **(extra_args or {}))
        out.append((updates, state))
    return state0, out


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
    tx = _build(tx, "check_purity")
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
    first = _build(tx, check)
    runs = [("a second run of the same transform", first)]
    if not _is_transform(tx):
        runs.append(("a run of a freshly built transform", _build(tx, check)))
    ref_state0, ref = _run(first, params, grads, steps, with_params, extra_args)
    fix = (" Fix: keep everything that changes between steps in the state (no Python-side "
           "counters in closures, no unseeded randomness).")
    for label, other in runs:
        state0, out = _run(other, params, grads, steps, with_params, extra_args)
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
    tx = _build(tx, "check_layout")
    state0, out = _run(tx, params, grads, steps, with_params, extra_args)
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
    tx = _build(tx, check)
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
        return _build(tx, check)

    def run(tx: GradientTransformation) -> list[tuple[Any, Any]]:
        return _run(tx, params, grads, steps, with_params, extra_args)[1]

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
    if not hasattr(functopt, "masked"):
        raise AssertionError(f"{check}: functopt.masked does not exist in this version.")
    if mask is None:
        mask = _default_mask(params)
    param_leaves, spec = _core.flatten(params)
    selected = [bool(m) for m in _core.flatten_like(spec, mask, name="mask", reference="params")]
    grad_leaves = _core.flatten_like(spec, grads, name="grads", reference="params")
    restricted_params = _core.unflatten(
        spec, [p if s else None for p, s in zip(param_leaves, selected, strict=True)])
    restricted_grads = _core.unflatten(
        spec, [g if s else None for g, s in zip(grad_leaves, selected, strict=True)])

    masked_out = _run(functopt.masked(_build(tx, check), mask), params, grads, steps,
                      with_params, extra_args)[1]
    reference = _run(_build(tx, check), restricted_params, restricted_grads, steps, with_params,
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


# --- the fast path -------------------------------------------------------------------------

# Per step, per leaf, in units of eps(dtype) times the leaf's largest magnitude before or
# after the step: the fused kernels round once where the pure chain rounds at each stage
# (measured at most 1.52 in float32, 0.96 in bfloat16, 1.00 in float16; tests/test_fast.py).
FAST_PATH_ULPS = {torch.float32: 3.0, torch.bfloat16: 2.0, torch.float16: 2.0}
FAST_PATH_REL_FLOAT64 = 1e-12
# An absolute floor of a few subnormal spacings, amplified by Adam's first step
# (lr / ((1 - b1) eps) with lr up to 1): both paths round a subnormal moment to the
# subnormal spacing (tests/test_fast.py measured 1.3e-38 in float32).
_FAST_PATH_FLOOR = 1e4


def _fast_path_tolerance(expected: torch.Tensor, before: Any) -> float:
    scale = float(expected.detach().double().abs().nan_to_num(posinf=0.0).max())
    if isinstance(before, torch.Tensor) and before.shape == expected.shape:
        scale = max(scale, float(before.detach().double().abs().nan_to_num(posinf=0.0).max()))
    finfo = torch.finfo(expected.dtype)
    if expected.dtype == torch.float64:
        return FAST_PATH_REL_FLOAT64 * scale + _FAST_PATH_FLOOR * finfo.smallest_normal
    return (FAST_PATH_ULPS.get(expected.dtype, 3.0) * finfo.eps * scale
            + _FAST_PATH_FLOOR * finfo.smallest_normal)


def _assert_fast_close(actual: Any, expected: Any, before: Any, *, check: str, what: str,
                       exact: bool) -> None:
    a_leaves, spec = _core.flatten(actual)
    e_leaves = _core.flatten_like(spec, expected, name="the pure step's", reference="fast")
    try:
        b_leaves = _core.flatten_like(spec, before, name="before", reference="fast")
    except (ValueError, TypeError):
        b_leaves = [None] * len(e_leaves)
    for i, (a, e, b) in enumerate(zip(a_leaves, e_leaves, b_leaves, strict=True)):
        where = _core.paths(spec)[i]
        if exact or not (isinstance(e, torch.Tensor) and e.is_floating_point()):
            difference = _compare.leaf_difference(a, e)
            if difference is not None:
                raise AssertionError(f"{check}: {what}, leaf {where!r}: the fast step differs "
                                     f"from the pure one: {difference} (fast vs pure).")
            continue
        if not (isinstance(a, torch.Tensor) and a.dtype == e.dtype and a.shape == e.shape):
            raise AssertionError(f"{check}: {what}, leaf {where!r}: the fast step gave "
                                 f"{_core._describe(a)} for {_core._describe(e)}.")
        finite = torch.isfinite(e)
        if not torch.equal(torch.isfinite(a), finite):
            raise AssertionError(f"{check}: {what}, leaf {where!r}: non-finite where the pure "
                                 f"step is finite, or the reverse.")
        if e.numel() == 0 or not bool(finite.any()):
            continue
        diff = float((a.double() - e.double())[finite].abs().max())
        tol = _fast_path_tolerance(e, b)
        if diff > tol:
            raise AssertionError(f"{check}: {what}, leaf {where!r}: the fast step differs from "
                                 f"the pure one by {diff:.3g} (tolerance {tol:.3g}).")


def check_fast_path(
    tx: TransformOrFactory, params: Any, grads: Any, steps: int = 2, *,
    with_params: bool = True, extra_args: Mapping[str, Any] | None = None,
    compile: bool = False,
) -> None:
    """``functopt.fast.make_step(tx)`` equals the pure step (see the module docstring).

    ``compile=True`` holds the compiled tier to the same law
    (``make_step(tx, compile=True)``, its state from ``step.init`` laid out flat as the
    tier wants it, and from ``tx.init`` as a user may pass it); each new structure
    compiles (seconds).

    Each step starts both paths from the pure path's params and state, so the tolerance is
    one step's rounding. ``with_params=False`` is not meaningful for a whole step and is
    ignored (make_step passes the params). Lost fast paths are allowed here (they are
    bitwise pure); their ``FastPathWarning`` is silenced.

    Raises:
        AssertionError: naming the step, the tree and the leaf that differ.

    Examples:
        >>> import torch, functopt
        >>> from functopt.testing import conformance
        >>> params = {"w": torch.ones(3, dtype=torch.float64)}
        >>> grads = {"w": torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)}
        >>> conformance.check_fast_path(lambda: functopt.chain(
        ...     functopt.clip_by_global_norm(1.0), functopt.adamw(0.1)), params, grads)
    """
    del with_params
    check = "check_fast_path"
    built = _build(tx, check)
    state = built.init(params)
    for step in range(1, steps + 1):
        tied = _tied(params)  # (the pure step returns new tensors: the ties end there)
        updates, pure_state = built.update(grads, state, params, **(extra_args or {}))
        pure_params = functopt.apply_updates(params, updates)
        for donate, flat in ((False, False), (True, False), *(
                ((False, True), (True, True)) if compile else ())):
            step_fn = make_step(built, donate=donate, compile=compile)
            inputs = _compare.clone_tree((grads, state, params))
            if flat:  # the state laid out as step.init lays it out, with the same values
                laid = step_fn.init(params)
                inputs = (inputs[0], optree.tree_map(
                    lambda x, v: x.copy_(v) if isinstance(x, torch.Tensor) else v, laid,
                    inputs[1]), inputs[2])
            if flat:  # stepped as they are (a clone would not be flat); compared with a copy
                g, s, p = inputs
                inputs = _compare.clone_tree(inputs)
            else:
                g, s, p = _compare.clone_tree(inputs)
            what = f"step {step}, donate={donate}" + (", flat state" if flat else "")
            # bitwise where the step stays pure on these inputs (a flat state can take the
            # compiled tier where the pure step's state, laid out otherwise, cannot)
            exact = not explain(built, p, s, g, compile=compile).fast
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore", FastPathWarning)
                if donate and tied:
                    _check_tied_refused(step_fn, (g, s, p), extra_args, tied, check=check,
                                        what=what)
                    continue
                new_params, new_state = step_fn(g, s, p, **(extra_args or {}))
            _assert_fast_close(new_params, pure_params, params, check=check,
                               what=f"{what}, params", exact=exact)
            _assert_fast_close(new_state, pure_state, state, check=check,
                               what=f"{what}, state", exact=exact)
            if not donate:
                difference = _compare.leaf_difference  # the inputs must be as they were
                for label, now, was in zip(("grads", "state", "params"), (g, s, p), inputs,
                                           strict=True):
                    a_leaves, spec = _core.flatten(now)
                    for i, (x, y) in enumerate(zip(a_leaves, _core.flatten(was)[0],
                                                   strict=True)):
                        found = difference(x, y)
                        if found is not None:
                            raise AssertionError(
                                f"{check}: {what}: the step wrote into leaf "
                                f"{_core.paths(spec)[i]!r} of its {label}: {found}.")
        params, state = pure_params, pure_state


def check_capture(
    tx: TransformOrFactory, params: Any, grads: Sequence[Any], *, compile: bool = False,
) -> None:
    """``step.capture`` of ``functopt.fast.make_step(tx, donate=True)``, replayed once per
    gradient tree of ``grads`` (one per step), equals the step called directly as it is
    recorded (bitwise: the same operations, in the device forms a recorded step takes, so
    nothing the replay keeps from the recording is stale) and the pure step (to the
    tolerance of `check_fast_path`), each step from the pure path's params and state
    (copied into the recorded tensors before the replay). Recording changes no value.

    On CUDA params the step is a real CUDA graph; on any other device it is recorded on a
    tape of its operations, replayed as a graph replays its kernels (the same operations,
    with the arguments of the recording), which refuses a value read back to the host as a
    CUDA graph does: so a CPU test tells whether a chain can be captured and replayed.
    Tied params must be refused (a ``ValueError`` naming them), and so must a param
    without a gradient.

    Raises:
        AssertionError: naming the step, the tree and the leaf that differ.
        functopt.fast.CaptureError: the step cannot be recorded (its message says why).

    Examples:
        >>> import torch, functopt
        >>> from functopt.testing import conformance
        >>> params = {"w": torch.ones(3, dtype=torch.float64)}
        >>> grads = [{"w": torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64) * k}
        ...          for k in (1, -2, 3)]
        >>> conformance.check_capture(lambda: functopt.chain(
        ...     functopt.clip_by_global_norm(1.0),
        ...     functopt.adamw(functopt.schedules.linear_schedule(0.1, 0.0, 5))), params, grads)
    """
    check = "check_capture"
    if isinstance(grads, (str, bytes)) or not isinstance(grads, Sequence) or not grads:
        raise TypeError(f"{check}: grads must be a non-empty sequence of gradient trees, one "
                        f"per step, got {type(grads).__name__}.")
    built = _build(tx, check)
    recorded = make_step(built, donate=True, compile=compile)
    p = _compare.clone_tree(params)
    s = recorded.init(p)
    g = _compare.clone_tree(grads[0])
    tied = _tied(params)
    missing = [path for path, (x, y) in zip(
        _core.paths(_core.structure(params)),
        zip(_core.flatten(params)[0],
            _core.flatten_like(_core.structure(params), grads[0], name="grads",
                               reference="params"), strict=True), strict=True)
        if x is not None and y is None]
    on_cuda = any(isinstance(x, torch.Tensor) and x.is_cuda for x in _core.flatten(params)[0])

    def capture(inputs: tuple[Any, Any, Any]) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FastPathWarning)
            return _capture.capture(recorded, *inputs, tape=not on_cuda)

    if tied or missing:
        _check_capture_refused(capture, (g, s, p), tied or missing, check=check,
                               what="tied params" if tied else "params without gradients")
        return
    before = _compare.clone_tree((g, s, p))
    captured = capture((g, s, p))
    _compare.assert_trees_equal((g, s, p), before, check=check,
                                what="the inputs after capture vs before it")
    direct = make_step(built, donate=True, compile=compile)
    state = built.init(params)
    for step, step_grads in enumerate(grads, 1):
        updates, pure_state = built.update(step_grads, state, params)
        pure_params = functopt.apply_updates(params, updates)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FastPathWarning)
            _copy_into(p, params, check=check, what="params")
            _copy_into(s, state, check=check, what="state")
            _copy_into(g, step_grads, check=check, what="grads")
            # the step called on the same values in the recorded tensors' layouts (which
            # decide its path), as it runs when recorded (a recording, thrown away), after
            # a warm-up call on the same tensors (undone) as capture makes one
            inputs = _compare.clone_tree((g, s, p))
            backup = _compare.clone_tree(inputs)
            direct(*inputs)
            _restore_changed(inputs, backup)
            with _capture._Tape():
                direct_params, direct_state = direct(*inputs)
            captured()
        what = f"step {step}"
        _compare.assert_trees_equal((p, s), (direct_params, direct_state), check=check,
                                    what=f"{what}: the replayed step vs the step run as "
                                         f"recorded")
        _assert_fast_close(p, pure_params, params, check=check, what=f"{what}, params",
                           exact=False)
        _assert_fast_close(s, pure_state, state, check=check, what=f"{what}, state",
                           exact=False)
        params, state = pure_params, pure_state


def _copy_into(target: Any, source: Any, *, check: str, what: str) -> None:
    """Write the tensors of ``source`` into those of ``target`` (one structure)."""
    leaves, spec = _core.flatten(target)
    for i, (t, x) in enumerate(zip(leaves, _core.flatten_like(spec, source, name=what,
                                                              reference="recorded"),
                                   strict=True)):
        if isinstance(t, torch.Tensor) and isinstance(x, torch.Tensor):
            t.copy_(x)
        elif t is not x and t != x:
            raise AssertionError(f"{check}: {what}, leaf {_core.paths(spec)[i]!r}: "
                                 f"{_core._describe(x)} where the recording holds "
                                 f"{_core._describe(t)}.")


def _restore_changed(target: Any, backup: Any) -> None:
    """Copy back the tensors of ``target`` whose bits differ from ``backup``'s (the others
    keep their version counters, by which a step knows what it read from them)."""
    for t, x in zip(_core.flatten(target)[0], _core.flatten(backup)[0], strict=True):
        if isinstance(t, torch.Tensor) and not _capture._same_bits(t, x):
            t.copy_(x)


def _check_capture_refused(capture: Callable[[Any], Any], inputs: tuple[Any, Any, Any],
                           paths: list[str], *, check: str, what: str) -> None:
    """``capture(inputs)`` raises a ValueError naming one of ``paths``, and writes nothing
    before it does."""
    before = _compare.clone_tree(inputs)
    try:
        capture(inputs)
    except ValueError as error:
        if not any(repr(path) in str(error) for path in paths):
            raise AssertionError(f"{check}: capture on {what} {paths} raised a ValueError "
                                 f"that does not name them: {error}") from error
    else:
        raise AssertionError(f"{check}: capture accepted {what} {paths}; it must raise a "
                             f"ValueError naming them.")
    _compare.assert_trees_equal(inputs, before, check=check,
                                what="the inputs of the refused capture vs before it")


def _tied(params: Any) -> list[str]:
    """The paths of the param leaves that are a non-empty tensor seen earlier in the tree
    (tied weights): a donated step must refuse them, since it would write them twice."""
    leaves, spec = _core.flatten(params)
    seen: set[int] = set()
    tied = []
    for path, x in zip(_core.paths(spec), leaves, strict=True):
        if isinstance(x, torch.Tensor) and x.numel():
            if id(x) in seen:
                tied.append(path)
            seen.add(id(x))
    return tied


def _check_tied_refused(step_fn: Callable[..., Any], inputs: tuple[Any, Any, Any],
                        extra_args: Mapping[str, Any] | None, tied: list[str], *,
                        check: str, what: str) -> None:
    """A donated step on tied params raises a ValueError naming a tied leaf, and writes
    nothing before it does."""
    before = _compare.clone_tree(inputs)
    try:
        step_fn(*inputs, **(extra_args or {}))
    except ValueError as error:
        if "share memory" not in str(error) or not any(repr(p) in str(error) for p in tied):
            raise AssertionError(f"{check}: {what}: a donated step on tied params {tied} "
                                 f"raised a ValueError that does not name them as sharing "
                                 f"memory: {error}") from error
    else:
        raise AssertionError(f"{check}: {what}: a donated step accepted the tied params "
                             f"{tied} (one tensor at two places of the tree), which it "
                             f"would update once per place; it must raise a ValueError.")
    _compare.assert_trees_equal(inputs, before, check=check,
                                what=f"{what}: the inputs of the refused step vs before it")


# --- all together --------------------------------------------------------------------------


def check_transform(
    tx: TransformOrFactory, params: Any, grads: Any, *, steps: int = 2, mask: Any = None,
    with_params: bool = True, extra_args: Mapping[str, Any] | None = None,
    skip: Collection[str] = (),
) -> None:
    """Run every conformance check on one transform (see `CHECKS`).

    The chain laws are checked with ``a = b = c = tx``; the masking law runs when
    ``functopt.masked`` exists.

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
    if "masked" not in skip and hasattr(functopt, "masked"):
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
