"""A ``MultiSteps`` inside a combinator on the fast path: ``masked``, ``partition``,
``inject_hyperparams``, or a chain beside them.

`_multi.Split` steps a ``MultiSteps`` that is the whole transform or one element of a chain
of per-leaf rules and clips. Anywhere else, the planner lowers it where it is the first rule
of the leaves it sees (so that what it accumulates are their gradients; a leading
``apply_if_finite`` may sit around it) (`_programs.Accumulation`). Each step then:

- decides the mini-step with the very code of the pure update, ``MultiSteps.window``, on
  the gradients and params of its leaves (``None`` at the others, as ``masked`` and
  ``partition`` hand them over), with the ``MultiSteps`` built from this step's
  hyperparameters inside an injection (its own ``update`` would run that one);
- takes the planner's step of the transform with the ``MultiSteps`` read as what it does at
  this mini-step (`_programs.MINI`, `_programs.CLOSING`): a mini-step that does not close the
  window returns zeros (``set_to_zero`` on its leaves: the other leaves take their kernels
  as always, and every counter and injected hyperparameter around it moves as on the pure
  path); the one that closes it is its inner transform on its state's ``inner_opt_state``,
  stepped on the window's accumulated gradients in place of its leaves' gradients;
- where rules come after it on its leaves (``chain(MultiSteps(...),
  masked(add_decayed_weights(...)), scale_by_learning_rate(...))``), a mini-step's zero
  updates reach them as zero gradients would, since it is the first rule there: those
  leaves take the kernels on zero gradients (`_programs.Structure.zeroed`);
- accumulates with one ``foreach`` running mean (or sum) per (device, dtype) group
  (`_multi.accumulate`, in place in ``acc_grads`` when donated), adds 0.0 to its leaves on a
  mini-step (`_multi.plus_zero`: a zero update turns -0.0 into 0.0), and writes its counters,
  accumulators and ``skip_state`` as its update does.

Under an ``apply_if_finite``, its verdict on the gradients is read on the host first: a
skipped step moves nothing inside the guard, and a closing mini-step's run is given that
verdict (its kernels see the accumulated gradients, which the guard does not check).

Nothing is written before the planner's step is known to be fast: a step it refuses runs
the pure update, whole.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from functopt.fast import _multi, _planned, _programs
from functopt.transforms import _common
from functopt.transforms.multi_steps import MultiSteps, MultiStepsState, Window
from functopt.tree import _core

__all__ = ["FOREIGN", "explained", "inside_step"]

# `inside_step`'s answer for a state that is not this transform's: the caller runs the pure
# update, which says what is wrong (no FastPathWarning: nothing fast was lost)
FOREIGN = "the state does not have the transform's layout"

Run = Callable[[_planned.Lowered, list[Any], dict[int, torch.Tensor]],
               "_planned.Result | str"]


def _filled(index_tree: Any, leaves: list[Any]) -> Any:
    """The subtree of the state whose leaves ``index_tree`` holds the flat indices of."""
    indices, spec = _core.flatten(index_tree)
    return _core.unflatten(spec, [leaves[k] for k in indices])


def multi_steps(acc: _programs.Accumulation, structure: _programs.Structure,
                state_leaves: list[Any]) -> MultiSteps | str:
    """The ``MultiSteps`` whose window this step decides: the one the walk met, or inside an
    injection the one built from this step's hyperparameters (as its update builds it)."""
    if acc.rebuild is None:
        ms: MultiSteps = acc.multi_steps
        return ms
    node, position = acc.rebuild
    found = _programs.accumulated_specs(_programs.injected_spec(structure, state_leaves, node))
    if len(found) <= position:
        return (f"{acc.where}: the injected transform built from this step's values has no "
                f"MultiSteps there")
    return found[position].multi_steps


def window(acc: _programs.Accumulation, ms: MultiSteps, treespec: _core.TreeSpec,
           param_leaves: list[Any], grad_leaves: list[Any], state_leaves: list[Any],
           ) -> Window | str:
    """This mini-step of ``ms`` as its update decides it, on what the combinators around it
    hand it (its leaves; ``None`` at the others), or why the step must stay pure (a state
    of another layout: the pure update then says what is wrong)."""
    idx = acc.state_at
    if not isinstance(idx, MultiStepsState):
        return FOREIGN
    view = MultiStepsState(
        mini_step=_filled(idx.mini_step, state_leaves),
        gradient_step=_filled(idx.gradient_step, state_leaves), inner_opt_state=None,
        acc_grads=_filled(idx.acc_grads, state_leaves),
        skip_state=_filled(idx.skip_state, state_leaves))
    chosen = set(acc.leaves)
    if len(chosen) < len(param_leaves):  # (else every leaf: the trees as given)
        grad_leaves = [g if i in chosen else None for i, g in enumerate(grad_leaves)]
        param_leaves = [p if i in chosen else None for i, p in enumerate(param_leaves)]
    found = ms.window(_core.unflatten(treespec, grad_leaves), view,
                      _core.unflatten(treespec, param_leaves))
    if len(_core.flatten(idx.acc_grads)[0]) != len(found.accs):
        return FOREIGN
    if _core.structure(found.skip_state) != _core.structure(view.skip_state):
        return (f"{acc.where}: should_skip_update_fn returned a skip_state of another "
                f"structure than the state's")
    return found


def inside_step(structure: _programs.Structure, lower: Callable[[str], _planned.Lowered],
                run: Run, finite: Callable[[int], torch.Tensor], treespec: _core.TreeSpec,
                param_leaves: list[Any], grad_leaves: list[Any], state_leaves: list[Any], *,
                donate: bool) -> _planned.Result | str:
    """One step of a transform with a ``MultiSteps`` inside (``structure.accumulation``):
    ``lower(mode)`` is the planner's lowering of the transform in that mode, ``run`` its
    step on these leaves with the gradients given (and the verdicts of the guards given),
    ``finite(guard)`` that guard's verdict on these gradients. Returns the result, or the
    reason the step must take the pure path, before anything was written."""
    acc = structure.accumulation
    assert acc is not None
    ms = multi_steps(acc, structure, state_leaves)
    if isinstance(ms, str):
        return ms
    found = window(acc, ms, treespec, param_leaves, grad_leaves, state_leaves)
    if isinstance(found, str):
        return found
    verdicts, guarded = _guarded(acc, structure, finite, state_leaves)
    closing = found.closes and not found.skip and not guarded
    lowered = lower(_programs.CLOSING if closing else _programs.MINI)
    if lowered.reason is not None:
        return _named(lowered, acc, "the closing mini-step" if closing else "a mini-step")
    present = [i for i, g in enumerate(found.leaves) if g is not None]
    grads = grad_leaves
    new_accs: list[Any] = found.accs
    zeroed = set(lowered.structure.zeroed) & set(present)
    if zeroed:  # (its zero updates reach rules after it: they run on zero gradients)
        grads = [torch.zeros_like(g) if i in zeroed else g for i, g in enumerate(grad_leaves)]
    accumulates = not (closing or found.skip or guarded)
    if closing and found.mini_step > 0:  # (a window of one steps on the gradient itself)
        summed = _multi.accumulate(ms, found, present, in_place=False)
        at = set(present)
        grads = [summed[i].to(g.dtype) if i in at else g for i, g in enumerate(grad_leaves)]
    elif accumulates and not donate:
        new_accs = _multi.accumulate(ms, found, present, in_place=False)
    result = run(lowered, grads, verdicts)
    if isinstance(result, str):
        return result
    if closing:
        new_accs = _multi.zeroed(found.accs, in_place=donate)
    else:  # its leaves' zero updates, added as apply_updates adds them
        # (the kernels stepped the zeroed ones, unless the guard skipped them)
        chosen = set(present) - (set() if guarded else zeroed)
        mask = [g if i in chosen else None for i, g in enumerate(found.leaves)]
        result.values = _multi.plus_zero(result.values, mask, donate=donate)
        if accumulates and donate:  # (after the step: a refused one writes nothing)
            new_accs = _multi.accumulate(ms, found, present, in_place=True)
    if not guarded:  # (the guard keeps the state inside it: the planner kept the rest)
        _write_window(result.leaves, acc.state_at, found, state_leaves, new_accs)
    return result


def _guarded(acc: _programs.Accumulation, structure: _programs.Structure,
             finite: Callable[[int], torch.Tensor], state_leaves: list[Any],
             ) -> tuple[dict[int, torch.Tensor], bool]:
    """``({guard: its verdict on these gradients}, whether it skips the step)`` for an
    ``apply_if_finite`` around the ``MultiSteps``, read on the host; ``({}, False)``: none."""
    if acc.guard is None:
        return {}, False
    guard = structure.guards[acc.guard]
    verdict = finite(acc.guard)
    count = int(state_leaves[guard.notfinite_count])
    count += count < _common.INT32_MAX  # (its safe_increment)
    return {acc.guard: verdict}, not (bool(verdict) or count > guard.max_consecutive_errors)


def _write_window(leaves: list[Any], idx: MultiStepsState, found: Window,
                  state_leaves: list[Any], new_accs: list[Any]) -> None:
    """Write the skip state, and unless skipped the counters and ``new_accs``, into the
    state's ``leaves`` (at the indices ``idx`` holds), as the update writes them."""
    writes = [(idx.skip_state, found.skip_state)]
    if not found.skip:
        view = MultiStepsState(_filled(idx.mini_step, state_leaves),
                               _filled(idx.gradient_step, state_leaves), None, None)
        new = found.next_state(view, _core.unflatten(found.treespec, new_accs))
        writes += [(idx.mini_step, new.mini_step), (idx.gradient_step, new.gradient_step),
                   (idx.acc_grads, new.acc_grads)]
    for at, value in writes:
        for k, x in zip(_core.flatten(at)[0], _core.flatten(value)[0], strict=True):
            leaves[k] = x


def explained(structure: _programs.Structure, lower: Callable[[str], _planned.Lowered],
              ) -> tuple[_planned.Lowered, _planned.Lowered]:
    """The lowerings of a mini-step and of the closing mini-step of a transform with a
    ``MultiSteps`` inside, for ``explain``; where one is not fast, both are the first
    refusal, with its reason named as such."""
    acc = structure.accumulation
    assert acc is not None
    mini, closing = lower(_programs.MINI), lower(_programs.CLOSING)
    for lowered, what in ((mini, "a mini-step"), (closing, "the closing mini-step")):
        if lowered.reason is not None:
            refused = _planned.Lowered(lowered.structure, lowered.state_spec, [],
                                       _named(lowered, acc, what))
            return refused, refused
    return mini, closing


def _named(lowered: _planned.Lowered, acc: _programs.Accumulation, what: str) -> str:
    """A refusal's reason, naming the mini-step it is of (a reason of the transform's
    structure, which every mini-step has, as it is)."""
    if lowered.structure.opaque:
        return str(lowered.reason)
    return f"{acc.where}: {what} of the MultiSteps: {lowered.reason}"
