"""The switch that routes ``make_step`` through the program engine: private and temporary.

``make_step(tx)(grads, state, params)`` runs on the program engine (the program of
``functopt/fast/_program.py`` and the executor of ``functopt/fast/_execute.py``) only
while `ENABLED` is true: set from the environment variable ``FUNCTOPT_ENGINE=program``
when ``functopt`` is imported, or assigned here (``functopt.fast._engine.ENABLED = True``,
as the tests do). Off, nothing changes. On, a step that the planner's path would take
after its checks (not differentiated, ``fused=True``) takes the program instead; a
transform whose program cannot be built, or cannot run on these leaves, keeps the
planner's path with a one-time [`FastPathWarning`][functopt.fast.FastPathWarning] per
structure naming the reason. The switch goes away when the engine becomes the default.
The adapters' flat entry (``Step._step_flat``, which ``functopt.Optimizer`` and every
``functopt.optim`` class step through) takes it on the same terms (`step_flat`), on the
state's leaves as the caller keeps them: the state tree is never rebuilt.

`BACKENDS` names the backends the engine offers each segment of a program, in order
(``functopt/fast/_backends.py``: ``"kernel"``, the fused kernels; ``"foreach"``,
torch.optim's foreach implementations, ``functopt/fast/_foreach.py``; ``"eager"``): a
segment the faster ones refuse runs on the eager one
(the rules' own updates), with a one-time ``FastPathWarning`` per program and reason;
`explain` says, per segment, which backend takes it and why the others do not.
"""

from __future__ import annotations

import os
import warnings
import weakref
from typing import Any

from functopt._collective.dtensor import _leaf_names
from functopt.fast import _backends, _errors, _planner
from functopt.fast._execute import execute_leaves, problem
from functopt.fast._program import Program, compile_program
from functopt.tree import _core

__all__ = ["BACKENDS", "ENABLED", "explain", "step", "step_flat"]

ENABLED: bool = os.environ.get("FUNCTOPT_ENGINE", "") == "program"
BACKENDS: tuple[str, ...] = ("kernel", "foreach", "perleaf", "eager")

_KEPT = 8  # programs kept per step function (one per params and state structure)
# per step function: its programs by (params structure, state structure), and the
# reasons it warned about
_PROGRAMS: weakref.WeakKeyDictionary[Any, dict[Any, Program]] = weakref.WeakKeyDictionary()
_WARNED: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()


def program_of(owner: Any, params: Any, treespec: _core.TreeSpec, param_leaves: list[Any],
               state_leaves: list[Any], state_spec: _core.TreeSpec) -> Program:
    """The program of ``owner.tx`` for these structures, compiled once per structure."""
    programs = _PROGRAMS.setdefault(owner, {})
    key = (treespec, state_spec)
    found = programs.get(key)
    if found is None:
        found = compile_program(owner.tx, params, treespec, param_leaves,
                                state_leaves, state_spec)
        if len(programs) >= _KEPT:
            programs.pop(next(iter(programs)))
        programs[key] = found
    return found


def step(owner: Any, param_leaves: list[Any], treespec: _core.TreeSpec,
         grad_leaves: list[Any], state: Any, params: Any, extra_args: dict[str, Any],
         ) -> tuple[Any, Any] | None:
    """``owner``'s step (a `Step`, on checked leaves) on the program engine, or None when
    the engine does not take it (warned once per reason)."""
    state_leaves, state_spec = _core.flatten(state)
    taken = _step_leaves(owner, param_leaves, treespec, grad_leaves, state_leaves,
                         state_spec, params, extra_args)
    if taken is None:
        return None
    return _core.unflatten(treespec, taken[0]), _core.unflatten(state_spec, taken[1])


def step_flat(owner: Any, param_leaves: list[Any], treespec: _core.TreeSpec,
              grad_leaves: list[Any], state_leaves: list[Any], state_spec: _core.TreeSpec,
              ) -> tuple[list[Any], list[Any], _core.TreeSpec] | None:
    """`step` for the adapters' flat entry (``Step._step_flat``, a step that is not
    differentiated): the params, gradients and state given as their leaves, with
    ``make_step``'s checks on them; the new params' and state's leaves and the state's
    structure, or None when the engine does not take the step (warned once per reason)."""
    _core.check_tensors(param_leaves, treespec, name="params", floating=True)
    _core.check_tensors(grad_leaves, treespec, name="grads", floating=True)
    _core.check_like(grad_leaves, param_leaves, treespec, name="grad", reference_name="param")
    taken = _step_leaves(owner, param_leaves, treespec, grad_leaves, state_leaves,
                         state_spec, None, {})
    if taken is None:
        return None
    return taken[0], taken[1], state_spec


def _step_leaves(owner: Any, param_leaves: list[Any], treespec: _core.TreeSpec,
                 grad_leaves: list[Any], state_leaves: list[Any], state_spec: _core.TreeSpec,
                 params: Any, extra_args: dict[str, Any]) -> tuple[list[Any], list[Any]] | None:
    """The engine's step on checked leaves (``params``: their tree, or None to build it
    when a program is compiled): the new params' and state's leaves, or None."""
    if extra_args:
        reason: str | None = "extra arguments to update have no program yet"
    else:
        if params is None and (treespec, state_spec) not in _PROGRAMS.get(owner, {}):
            params = _core.unflatten(treespec, param_leaves)
        program = program_of(owner, params, treespec, param_leaves, state_leaves, state_spec)
        reason = problem(program, param_leaves)
    if reason is not None:
        warned = _WARNED.setdefault(owner, set())
        if reason not in warned:
            warned.add(reason)
            warnings.warn(
                f"make_step: the program engine (FUNCTOPT_ENGINE=program) does not take "
                f"this step: {reason}; it runs on the planner's path.",
                _errors.FastPathWarning, stacklevel=5)
        return None
    name = _leaf_names(treespec)
    if owner.donate:
        _planner.check_donation(param_leaves, name)
    values, leaves = execute_leaves(program, treespec, param_leaves, grad_leaves,
                                    state_leaves, donate=owner.donate, backends=BACKENDS)
    for refusal in _backends.unwarned(program):
        warnings.warn(f"make_step: the program engine's {refusal}; the eager backend (the "
                      f"rules' own updates) runs it.", _errors.FastPathWarning, stacklevel=5)
    return values, leaves


def explain(tx: Any, params: Any, grads: Any, state: Any = None, *, donate: bool = False,
            ) -> list[_backends.Explained] | str:
    """Per segment of ``tx``'s program on these trees (``state``: ``tx.init(params)`` when
    None), the backend of `BACKENDS` that takes it and the reasons of those before it; or
    the reason the engine has no program for them."""
    param_leaves, treespec = _core.flatten(params)
    grad_leaves = _core.flatten_like(treespec, grads, name="grads", reference="params")
    state_leaves, state_spec = _core.flatten(tx.init(params) if state is None else state)
    program = compile_program(tx, params, treespec, param_leaves, state_leaves, state_spec)
    reason = problem(program, param_leaves)
    if reason is not None:
        return reason
    return _backends.explain(program, treespec, param_leaves, grad_leaves, state_leaves,
                             donate=donate, backends=BACKENDS)
