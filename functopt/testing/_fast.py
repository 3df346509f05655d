"""The fast-path laws of the conformance suite: ``check_fast_path`` and ``check_capture``.

Both are public as ``functopt.testing.conformance.check_fast_path`` and
``functopt.testing.conformance.check_capture`` (see that module's docstring for the laws).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optree
import torch

import functopt
from functopt.fast import FastPathWarning, _capture, explain, make_step
from functopt.testing import _compare
from functopt.testing._running import TransformOrFactory, build
from functopt.tree import _core

__all__ = ["FAST_PATH_REL_FLOAT64", "FAST_PATH_ULPS", "check_capture", "check_fast_path"]

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
    built = build(tx, check)
    state = built.init(params)
    for step in range(1, steps + 1):
        tied = _tied(params)  # (the pure step returns new tensors: the ties end there)
        updates, pure_state = built.update(grads, state, params, **(extra_args or {}))
        pure_params = functopt.apply_updates(params, updates)
        for donate, flat in ((False, False), (True, False), *(
                ((False, True), (True, True)) if compile else ())):
            step_fn = make_step(built, donate=donate, compile=compile)
            inputs = _compare.clone_tree((grads, state, params))
            if flat:  # the state laid out as step.init lays it out, with the same values,
                # stepped as they are (a clone would not be flat) and compared with a copy
                g, s, p = inputs = (inputs[0], optree.tree_map(
                    lambda x, v: x.copy_(v) if isinstance(x, torch.Tensor) else v,
                    step_fn.init(params), inputs[1]), inputs[2])
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
    built = build(tx, check)
    recorded = make_step(built, donate=True, compile=compile)
    p = _compare.clone_tree(params)
    s = recorded.init(p)
    g = _compare.clone_tree(grads[0])
    tied = _tied(params)
    leaves, spec = _core.flatten(params)
    missing = [path for path, x, y in zip(_core.paths(spec), leaves, _core.flatten_like(
        spec, grads[0], name="grads", reference="params"), strict=True)
        if x is not None and y is None]
    on_cuda = any(isinstance(x, torch.Tensor) and x.is_cuda for x in leaves)

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
