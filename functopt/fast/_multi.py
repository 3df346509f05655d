"""``MultiSteps`` on the fast path: as the whole transform, or as one element of a chain.

``make_step(MultiSteps(inner, k))`` and ``make_step(chain(prefix..., MultiSteps(inner,
k).gradient_transformation(), suffix...))`` (``named_chain`` too, nested chains flattened)
are stepped here (the mixed-precision step does the same in
``functopt/precision/_fused_multi.py``'s ``fused_multi_step``), with the semantics of the pure
``chain``:

- the prefix (the elements before the ``MultiSteps``: per-leaf rules, global-norm
  clips) runs on every call, with its own update, as the pure chain runs it: a clip
  measures each mini-step's gradients;
- ``MultiSteps.window`` decides the mini-step (its checks, ``should_skip_update_fn``,
  whether the window closes), with the very code of the pure ``update``;
- a mini-step accumulates the prefix's output with one ``foreach`` running mean (or sum)
  per (device, dtype) group (`accumulate`: the pure operations in the same order, hence
  bitwise), in place in ``acc_grads`` when donated; its updates are MultiSteps' zeros,
  which the suffix then sees, as in the pure chain (a zero update adds 0.0: `plus_zero`);
- the closing mini-step runs the fast step of ``chain(inner, suffix...)`` on the
  accumulated gradients (``inner`` alone without a suffix), so the inner rule and what
  follows it keep their kernels, clips and guards.

A ``MultiSteps`` anywhere else (inside ``masked``, ``partition``, ``inject_hyperparams`` or
``apply_if_finite``, or beside an element that is not a per-leaf rule or a clip) is not a
`Split`: ``make_step`` lowers it with the planner where it is the first rule of its leaves
(``functopt/fast/_inside.py``); elsewhere, and in the mixed-precision step, the step is
pure, with a ``FastPathWarning``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from functopt._base import GradientTransformation, Params, State, Updates
from functopt._collective.dtensor import _rewrap_like, local_tensor
from functopt._spec import GlobalNormClip, Leafwise, Sequence, Spec, describe, specified
from functopt.transforms.clipping import clip_by_global_norm
from functopt.transforms.combining import chain
from functopt.transforms.multi_steps import Accumulated, MultiSteps, MultiStepsState, Window
from functopt.tree import _core

__all__ = ["Split", "accumulate", "closed", "get", "multi_step", "plus_zero", "put"]

Path = tuple[Any, ...]  # keys from a chain's state to an element's (tuple index, dict key)

# Why a MultiSteps that is not a Split stays opaque to a step that does not read it as
# functopt/fast/_inside.py does (the mixed-precision step's), for the planner's message
NOT_SPLIT = (
    "MultiSteps inside masked, partition, inject_hyperparams or apply_if_finite, or in a chain "
    "beside them, is lowered by make_step only; the mixed-precision step lowers it as the whole transform or "
    "as one element of a chain or named_chain whose other elements are per-leaf rules or "
    "clip_by_global_norm")


def _uninitialised(params: Params) -> State:
    del params
    raise TypeError("a chain element rebuilt from its spec by the MultiSteps fast path has "
                    "no init: initialise the chain itself")


def _element(spec: Spec | None) -> GradientTransformation | None:
    """The transform a chain element's spec describes, for its pure update, or None when
    the spec does not say it whole (only per-leaf rules, which carry their update, and
    clips, rebuilt by their factory, are)."""
    if isinstance(spec, GlobalNormClip):
        return clip_by_global_norm(spec.max_norm)  # its own factory: the same closure
    if isinstance(spec, Leafwise) and spec.update is not None:  # (PerLeaf ones too)
        return specified(GradientTransformation(_uninitialised, spec.update), spec)
    return None


def _elements(spec: Spec | None, path: Path) -> list[tuple[Spec | None, Path]]:
    """A chain's elements in order with the paths of their states (nested chains flat)."""
    if isinstance(spec, Sequence):
        keys: Any = range(len(spec.children)) if spec.names is None else spec.names
        return [e for key, child in zip(keys, spec.children, strict=True)
                for e in _elements(child, (*path, key))]
    return [(spec, path)]


def _fits(spec: Spec | None, state: Any) -> bool:
    """Whether ``state`` has the layout of the chains of ``spec`` (down to their elements)."""
    if not isinstance(spec, Sequence):
        return True
    if spec.names is None:
        return isinstance(state, tuple) and len(state) == len(spec.children) and all(
            _fits(child, sub) for child, sub in zip(spec.children, state, strict=True))
    return isinstance(state, dict) and set(state) == set(spec.names) and all(
        _fits(child, state[name]) for child, name in zip(spec.children, spec.names,
                                                         strict=True))


def get(state: Any, path: Path) -> Any:
    for key in path:
        state = state[key]
    return state


def put(state: Any, path: Path, value: Any) -> Any:
    """``state`` with the entry at ``path`` replaced (tuples and dicts rebuilt, not written)."""
    if not path:
        return value
    key, rest = path[0], path[1:]
    if isinstance(state, dict):
        return {**state, key: put(state[key], rest, value)}
    items = list(state)
    items[key] = put(state[key], rest, value)
    return tuple(items)


@dataclass(frozen=True)
class Split:
    """A transform cut at its ``MultiSteps``: the elements before it (``prefix``), the
    ``MultiSteps`` (its state at ``path``) and the elements after it (``suffix``), each with
    the path of its state; ``closing`` is what the closing mini-step steps fast:
    ``chain(inner, *suffix)``, or ``inner`` alone."""

    ms: MultiSteps
    path: Path
    prefix: tuple[tuple[GradientTransformation, Path], ...]
    suffix: tuple[tuple[GradientTransformation, Path], ...]
    closing: GradientTransformation
    whole: GradientTransformation  # the transform split (its pure update, for a bad state)
    spec: Spec  # its spec: the chains' layouts, which the state must have

    @classmethod
    def of(cls, tx: GradientTransformation) -> Split | None:
        """The split of ``tx``, or None: no ``MultiSteps`` at its root or in its chain,
        or one in a place this module does not lower (see the module docstring)."""
        spec = describe(tx)
        if isinstance(spec, Accumulated):
            ms = spec.multi_steps
            return cls(ms, (), (), (), ms.inner_opt, tx, spec)
        if not isinstance(spec, Sequence):
            return None
        elements = _elements(spec, ())
        at = [i for i, (s, _) in enumerate(elements) if isinstance(s, Accumulated)]
        if len(at) != 1:
            return None
        rebuilt = [(_element(s), path) for s, path in elements]
        if any(t is None for i, (t, _) in enumerate(rebuilt) if i != at[0]):
            return None
        found = elements[at[0]][0]
        assert isinstance(found, Accumulated)
        ms = found.multi_steps
        parts = [(t, p) for t, p in rebuilt if t is not None]
        prefix, suffix = tuple(parts[:at[0]]), tuple(parts[at[0]:])
        closing = chain(ms.inner_opt, *(t for t, _ in suffix)) if suffix else ms.inner_opt
        return cls(ms, elements[at[0]][1], prefix, suffix, closing, tx, spec)

    @property
    def label(self) -> str:
        """How ``explain`` names the closing step."""
        if not (self.prefix or self.suffix):
            return "MultiSteps' inner transform"
        return "MultiSteps' closing step (its inner transform, then the chain after it)"

    def summary(self) -> str:
        """What every mini-step runs, for ``explain``."""
        before = ", ".join(repr(describe(t)) for t, _ in self.prefix)
        after = ", ".join(repr(describe(t)) for t, _ in self.suffix)
        return "".join((
            "MultiSteps: each mini-step runs ", f"{before} (its update), " if before else "",
            "a foreach accumulation per (device, dtype) group",
            f", {after} on the zero updates" if after else "",
            "; the closing one the inner transform", f" then {after}" if after else "",
            " on the accumulated gradients"))

    def multi_state(self, state: Any) -> MultiStepsState | None:
        """The ``MultiSteps`` state within ``state``, or None where ``state`` does not have
        the layout of the chains (a tuple per ``chain``, a dict per ``named_chain``, with
        an entry per element) or no ``MultiStepsState`` at its place: the caller then runs
        the pure update, which says what is wrong."""
        if not _fits(self.spec, state):
            return None
        found = get(state, self.path)
        return found if isinstance(found, MultiStepsState) else None

    def closing_state(self, state: Any) -> Any:
        """The state of ``closing`` within ``state`` (the MultiSteps state must be there)."""
        ms_state = get(state, self.path)
        if not self.suffix:
            return ms_state.inner_opt_state
        return (ms_state.inner_opt_state, *(get(state, p) for _, p in self.suffix))


def multi_step(split: Split, closing_step: Callable[..., tuple[Params, State]],
               apply: Callable[[list[Any], Any, Updates, bool], Params], grads: Updates,
               state: Any, params: Params, extra_args: dict[str, Any], *,
               donate: bool) -> tuple[Params, State]:
    """One step of a `Split` transform (see the module docstring); ``closing_step`` is the
    fast step of ``split.closing``, ``apply`` the grouped ``apply_updates``
    ``(param leaves, treespec, updates, donate)``."""
    ms = split.ms
    if split.multi_state(state) is None:  # (not this transform's state: its own error)
        updates, new_state = split.whole.update(grads, state, params, **extra_args)
        param_leaves, param_spec = _core.flatten(params)
        return apply(param_leaves, param_spec, updates, donate), new_state
    new_state = state
    updates = grads
    for tx, path in split.prefix:  # (pure updates: new tensors, the caller's untouched)
        updates, sub = tx.update(updates, get(state, path), params, **extra_args)
        new_state = put(new_state, path, sub)
    ms_state = get(state, split.path)
    window = ms.window(updates, ms_state, params)
    treespec = window.treespec
    present = [i for i, g in enumerate(window.leaves) if g is not None]
    if window.skip or not window.closes:
        if window.skip:
            new_ms = ms_state._replace(skip_state=window.skip_state)
        else:
            new_accs = accumulate(ms, window, present, in_place=donate)
            new_ms = window.next_state(ms_state, _core.unflatten(treespec, new_accs))
        new_state = put(new_state, split.path, new_ms)
        param_leaves, param_spec = _core.flatten(params)
        if not split.suffix:
            return _core.unflatten(param_spec, plus_zero(param_leaves, window.leaves,
                                                         donate=donate)), new_state
        # the suffix sees MultiSteps' zeros, as in the pure chain (a decay then moves the
        # params, a count advances)
        zeros = _core.unflatten(treespec, _core.map_leaves(torch.zeros_like, window.leaves))
        for tx, path in split.suffix:
            zeros, sub = tx.update(zeros, get(state, path), params, **extra_args)
            new_state = put(new_state, path, sub)
        return apply(param_leaves, param_spec, zeros, donate), new_state
    if window.mini_step == 0:
        inner_grads = updates  # a window of one: the gradient itself, as on the pure path
    else:  # (out of place: the inner step may keep the accumulated gradients)
        summed = accumulate(ms, window, present, in_place=False)
        inner_grads = _core.unflatten(treespec, [
            None if g is None else a.to(g.dtype)
            for g, a in zip(window.leaves, summed, strict=True)])
    new_params, new_closing = closing_step(inner_grads, split.closing_state(state), params,
                                           **extra_args)
    return new_params, closed(split, new_state, window, new_closing, in_place=donate)


def closed(split: Split, state: Any, window: Window, closing_state: Any, *,
           in_place: bool) -> Any:
    """``state`` after a closing mini-step whose closing transform left ``closing_state``:
    the inner state and the suffix's states put back, the accumulators reset (in place)."""
    ms_state = get(state, split.path)
    inner_state = closing_state[0] if split.suffix else closing_state
    for (_, path), sub in zip(split.suffix, closing_state[1:] if split.suffix else (),
                              strict=True):
        state = put(state, path, sub)
    acc_grads = _core.unflatten(window.treespec, zeroed(window.accs, in_place=in_place))
    return put(state, split.path, window.next_state(ms_state, acc_grads, inner_state))


def zeroed(accs: list[Any], *, in_place: bool) -> list[Any]:
    """The accumulators reset for a new window: zeroed in place (one ``foreach`` call), or
    new zeros."""
    if in_place:
        tensors = [local_tensor(a) for a in accs if a is not None]
        if tensors:  # (a MultiSteps that sees no leaf, inside masked: nothing to reset)
            with torch.no_grad():
                torch._foreach_zero_(tensors)
        return accs
    return _core.map_leaves(torch.zeros_like, accs)


def plus_zero(leaves: list[Any], grads: list[Any], *, donate: bool) -> list[Any]:
    """Each leaf that has a gradient plus 0.0 (as a zero update adds: bitwise the leaf but
    for -0.0, which becomes 0.0), one ``foreach`` add per (device, dtype) group, in place
    when donated; the other leaves as they are."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, (p, g) in enumerate(zip(leaves, grads, strict=True)):
        if p is not None and g is not None:
            groups.setdefault((p.device, p.dtype), []).append(i)
    out = list(leaves)
    with torch.no_grad():
        for idx in groups.values():
            ps = [local_tensor(leaves[i]) for i in idx]
            if donate:
                torch._foreach_add_(ps, 0.0)
            else:
                for i, t in zip(idx, torch._foreach_add(ps, 0.0), strict=True):
                    out[i] = _rewrap_like(leaves[i], t)
    return out


def accumulate(ms: MultiSteps, window: Window, present: list[int], *,
               in_place: bool, scratch: list[bool] | None = None) -> list[Any]:
    """The accumulators after this mini-step's gradients: ``acc + (g - acc) / n`` (the
    running mean) or ``acc + g``, as ``MultiSteps`` computes them per leaf (the same
    operations, so bitwise its values), one ``foreach`` call per (device, dtype) group, on
    local shards (a DTensor accumulator and gradient: their shards, the result rewrapped
    like the accumulator). ``scratch[i]``: the caller's gradient ``i`` is its own to
    overwrite (a cast), so the difference, and out of place the result (``g + acc``,
    bitwise ``acc + g``), is computed in it: no new tensor."""
    accs, leaves = window.accs, window.leaves
    out = list(accs)
    groups: dict[tuple[torch.device, torch.dtype, bool], list[int]] = {}
    for i in present:
        mine = scratch is not None and scratch[i] and leaves[i].dtype == accs[i].dtype
        groups.setdefault((accs[i].device, accs[i].dtype, mine), []).append(i)
    with torch.no_grad():
        for (_, dtype, mine), idx in groups.items():
            a = [local_tensor(accs[i]) for i in idx]
            g = [local_tensor(leaves[i]).to(dtype) for i in idx]
            delta: list[torch.Tensor] | tuple[torch.Tensor, ...] = g
            if ms.use_grad_mean:
                if mine:
                    torch._foreach_sub_(g, a)
                else:
                    delta = torch._foreach_sub(g, a)
                torch._foreach_div_(delta, window.mini_step + 1)
            if in_place:
                torch._foreach_add_(a, delta)
                new = [accs[i] for i in idx]
            elif mine:
                torch._foreach_add_(list(delta), a)
                new = [_rewrap_like(accs[i], t) for i, t in zip(idx, delta, strict=True)]
            else:
                new = [_rewrap_like(accs[i], t)
                       for i, t in zip(idx, torch._foreach_add(a, delta), strict=True)]
            for i, t in zip(idx, new, strict=True):
                out[i] = t
    return out
