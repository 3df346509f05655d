r"""The private engine's executor: runs a step's program (``functopt/fast/_program.py``).

One entry point, `execute_leaves`, on the flat leaves of the params, gradients and state;
`execute` is the tree wrapper. A step:

1. runs the ops in order on the updates (the gradients at first) and the flat state;
2. resolves each of the program's bindings (``inject_hyperparams``, outer ones first) where
   an op first needs it: its values read from the state as the pure update reads them,
   its inner transform built from them once for the step;
3. resolves reductions at *barriers*: a `Reduce` computes this rank's part at once (from
   the local shards of DTensor leaves, each replicated value counted on one rank) and
   leaves it pending; the first op that reads a pending result resolves every pending one
   together, with one packed all-reduce when there is a process group (given, or inferred
   from the DTensor leaves' mesh) through ``functopt/_collective/stats.py``. So a step
   makes ``program.barriers`` collectives on a mesh and none on one process;
4. adds the updates to the params (`Write`): one ``foreach`` add per (device, dtype) group,
   in place when donated.

At the first `Map` of each run of Maps (a *segment*) the backends of
``functopt/fast/_backends.py`` are offered it in order (``backends``): a faster one that
takes it (PyTorch's fused kernels, torch.optim's foreach implementations) runs the
whole segment. The last is the eager one, the
reference, which takes the rest: a `Map` calls its rule's own pure ``update``
(a `PerLeaf` rule's ``grouped`` update when it has one) on the params' tree with ``None``
outside its leaves, as ``masked`` calls an inner transform; an elementwise rule is called
once per (device, dtype) group of its leaves, the others once on all of them. A `Gate`
on a device decision runs both branches and selects with ``torch.where``, as
``apply_if_finite`` does; a `Gate` on a ``MultiSteps`` `Window` decides on the host with
the pure update's own ``MultiSteps.window`` and runs the branch it picks, and its
`Accumulate` ops take the mini-step into the window's state with ``MultiSteps``' own
accumulation and counters (``Window.next_state``). The
arithmetic is the pure path's, so the results equal it bitwise (tests/laws/test_program.py).
It is not faster than the pure path: it is the reference the faster backends are held to
(tests/laws/test_backends.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from functopt._collective import stats
from functopt._collective.dtensor import (
    _infer_group,
    _leaf_names,
    _rewrap_like,
    is_dtensor,
    local_tensor,
)
from functopt._spec import GlobalNormClip
from functopt.fast import _backends
from functopt.fast._program import (
    Accumulate,
    Gate,
    Map,
    Op,
    Program,
    Record,
    Reduce,
    Resolved,
    Rule,
    Scale,
    Window,
    Write,
    resolve_binding,
)
from functopt.transforms import _common
from functopt.tree import _core

__all__ = ["INFERRED", "execute", "execute_leaves", "problem"]

INFERRED: Any = object()  # the process group from the params' DTensor meshes


def problem(program: Program, param_leaves: list[Any]) -> str | None:
    """Why the executor cannot run ``program`` on these params, or None."""
    if program.reason is not None:
        return program.reason
    if any(map(is_dtensor, param_leaves)) and _has_sums(program.ops):
        return ("a rule with tree sums (Prodigy, D-Adaptation) on DTensor leaves has no "
                "program step yet (its sums would be DTensors)")
    return None


def _has_sums(ops: tuple[Op, ...]) -> bool:
    return any((isinstance(op, Reduce) and op.kind == "sums")
               or (isinstance(op, Gate) and (_has_sums(op.then) or _has_sums(op.otherwise)))
               for op in ops)


@dataclass
class _Run:
    """One step in flight."""

    program: Program
    treespec: _core.TreeSpec
    params: list[Any]
    updates: list[Any]
    state: list[Any]
    counted: list[bool]  # per leaf: whether this rank counts it in a sum over the ranks
    group: Any  # the process group reductions are summed over, or None
    device: torch.device  # where a reduction over no counted leaf lives
    results: dict[int, Any] = field(default_factory=dict)
    pending: dict[int, Any] = field(default_factory=dict)
    # per binding resolved: its values and its inner transform's nodes (`bound`)
    resolved: dict[int, Resolved] = field(default_factory=dict)
    # per window decided: (its MultiSteps, its state as it was, the verdict: a
    # ``multi_steps.Window``)
    windows: dict[int, tuple[Any, Any, Any]] = field(default_factory=dict)
    donate: bool = False  # the params and state are handed over (a kernel writes in place)
    # the backends offered each segment of Maps, in order (``functopt/fast/_backends.py``),
    # and the Maps one other than the eager backend ran
    backends: tuple[_backends.Backend, ...] = (_backends.EAGER,)
    taken: set[Map] = field(default_factory=set)
    # per reduction pending or resolved: the updates it measured; per leaf whose update a
    # clip scaled since: the sum of squares that clip divided by (a bound of its update,
    # which a backend's range check reads instead of the update)
    measured: dict[int, dict[int, Any]] = field(default_factory=dict)
    clipped: dict[int, torch.Tensor] = field(default_factory=dict)

    def tree(self, leaves: list[Any], sel: tuple[int, ...]) -> Any:
        chosen = set(sel)
        return _core.unflatten(self.treespec, [x if i in chosen else None
                                               for i, x in enumerate(leaves)])

    def spec(self, rule: Rule) -> Any:
        """The rule's node for this step (inside inject_hyperparams: built from its values)."""
        if rule.bound is None:
            return rule.spec
        binding, position = rule.bound
        node = self.bound(binding).nodes[position]
        if type(node) is not type(rule.spec):
            raise ValueError(f"{rule.where}: the injected transform built from this step's "
                             f"values has {node!r} where {rule.spec!r} was compiled")
        return node

    def bound(self, index: int) -> Resolved:
        """Binding ``index`` at this step, resolved at first use (`resolve_binding`)."""
        return resolve_binding(self.program, self.state, self.resolved, index)

    def state_of(self, rule: Rule) -> Any:
        keys, spec = _core.flatten(rule.state_at)
        return _core.unflatten(spec, [self.state[k] for k in keys])

    def result(self, index: int) -> Any:
        """A reduction's value summed over the ranks: resolves the pending ones together."""
        if index in self.pending:
            _resolve(self)
        return self.results[index]


def _resolve(run: _Run) -> None:
    """Every pending reduction, summed over the ranks in one packed all-reduce."""
    pending, run.pending = run.pending, {}
    if run.group is None:
        run.results.update(pending)
        return
    tuples = {k: v if isinstance(v, tuple) else (v,) for k, v in pending.items()}
    summed = stats.all_reduce_parts(stats.pack_sums(tuples), run.group)
    for k, found in stats.unpack_sums(tuples, summed).items():
        run.results[k] = found if isinstance(pending[k], tuple) else found[0]


# --- the eager backend ------------------------------------------------------------------

def _groups(run: _Run, op: Map, spec: Any) -> list[tuple[int, ...]]:
    """The calls of ``op``'s rule: per (device, dtype) group of its leaves where it is
    elementwise, else one call on all of them; on no leaf, one call (as ``masked`` calls
    its inner transform on a tree of ``None``, which still advances a count)."""
    if not op.rule.elementwise or getattr(spec, "sums", None) is not None:
        return [op.sel]
    found: dict[Any, list[int]] = {}
    for i in op.sel:
        x = run.updates[i] if run.updates[i] is not None else run.params[i]
        local = local_tensor(x)
        found.setdefault((local.device, local.dtype), []).append(i)
    return [tuple(leaves) for leaves in found.values()] or [op.sel]


def _map(run: _Run, op: Map) -> None:
    if _backends.take(run, op):  # (a faster backend ran it, with the rest of its segment)
        return
    spec = run.spec(op.rule)
    state = run.state_of(op.rule)  # (every call from the state before the rule)
    update = getattr(spec, "grouped", None) or spec.update
    for j, leaves in enumerate(_groups(run, op, spec)):
        updates, params = run.tree(run.updates, leaves), run.tree(run.params, leaves)
        if op.totals is not None:
            out, new = spec.finish(updates, state, params, run.result(op.totals))
        else:
            out, new = update(updates, state, params)
        flat = run.treespec.flatten_up_to(out)
        for i in leaves:
            run.updates[i] = flat[i]
            run.clipped.pop(i, None)
        _written(run, op.rule, new, leaves, shared=j == 0)


def _written(run: _Run, rule: Rule, new: Any, leaves: tuple[int, ...], shared: bool) -> None:
    """The rule's new state into the flat state: its per-leaf entries of ``leaves`` and,
    from its first call, its other entries (a count, NAdam's product: the same in every
    call of a step, which all start from the same state)."""
    at = rule.state_at
    for name in rule.slots:
        keys: list[Any] = run.treespec.flatten_up_to(getattr(at, name))
        entries = run.treespec.flatten_up_to(getattr(new, name))
        for i in leaves:
            if isinstance(keys[i], int):
                run.state[keys[i]] = entries[i]
    if not shared:
        return
    fields = getattr(at, "_fields", None)
    pairs = [(at, new)] if fields is None else [
        (getattr(at, f), getattr(new, f)) for f in fields if f not in rule.slots]
    for old, fresh in pairs:
        for k, v in zip(_core.flatten(old)[0], _core.flatten(fresh)[0], strict=True):
            run.state[k] = v


def _reduce(run: _Run, op: Reduce) -> None:
    """This rank's part of a reduction, left pending until an op reads it."""
    if op.kind == "sums":
        assert op.rule is not None
        spec = run.spec(op.rule)
        run.pending[op.out] = tuple(spec.sums(run.tree(run.updates, op.sel),
                                              run.state_of(op.rule),
                                              run.tree(run.params, op.sel)))
        return
    chosen = set(op.sel)
    tensors = [local_tensor(u) if i in chosen and u is not None else None
               for i, u in enumerate(run.updates)]
    # (the leaves in index order: the order global_norm adds their squares in)
    measure = stats.clip_sums if op.kind == "sumsq" else stats.nonfinite_counts
    run.pending[op.out] = measure(tensors, run.counted, [sorted(chosen)], run.device)[0]
    if op.kind == "sumsq":  # (what a clip then scales: see `_scale`)
        run.measured[op.out] = {i: run.updates[i] for i in chosen}


def _scale(run: _Run, op: Scale) -> None:
    spec = run.spec(op.rule)
    total = run.result(op.source)
    out, _ = spec.finish(run.tree(run.updates, op.sel), run.state_of(op.rule),
                         run.tree(run.params, op.sel), (total,))
    flat = run.treespec.flatten_up_to(out)
    measured = run.measured.get(op.source, {})
    for i in op.sel:
        # (clip_by_global_norm scales by min(1, max_norm / norm): the norm of the updates
        # it measured bounds each scaled one)
        if (isinstance(spec, GlobalNormClip) and run.updates[i] is not None
                and measured.get(i) is run.updates[i]):
            run.clipped[i] = total
        else:
            run.clipped.pop(i, None)
        run.updates[i] = flat[i]


def _gate(run: _Run, op: Gate) -> None:
    """Both branches from the same updates and state, selected as apply_if_finite does; or,
    on a `Window`, the branch the window picks."""
    if isinstance(op.decide, Window):
        _window(run, op, op.decide)
        return
    updates, state = list(run.updates), list(run.state)
    _ops(run, op.then)
    taken_updates, taken_state = run.updates, run.state
    run.updates, run.state = list(updates), list(state)
    _ops(run, op.otherwise)
    d = op.decide
    old_count = state[d.notfinite_count]
    finite = (run.result(d.source) == 0).to(old_count.device)
    count = torch.where(finite, torch.zeros_like(old_count),
                        _common.safe_increment(old_count))
    total = torch.where(finite, state[d.total_notfinite],
                        _common.safe_increment(state[d.total_notfinite]))
    apply = finite | (count > d.max_consecutive_errors)
    changed = [k for k in range(len(state))
               if taken_state[k] is not state[k] or run.state[k] is not state[k]]
    kept = _common.select_tree(~apply, [run.state[k] for k in changed],
                               [taken_state[k] for k in changed], owner="apply_if_finite",
                               name="inner state")
    for k, v in zip(changed, kept, strict=True):
        run.state[k] = v
    applied = _common.OnDevice(apply)
    for i in op.sel:
        u = taken_updates[i]
        run.updates[i] = None if u is None else torch.where(applied.on(u.device), u,
                                                            run.updates[i])
        run.clipped.pop(i, None)
    run.state[d.notfinite_count], run.state[d.last_finite] = count, finite
    run.state[d.total_notfinite] = total


def _window(run: _Run, op: Gate, window: Window) -> None:
    """A ``MultiSteps``' mini-step decided on the host by its own ``window`` (its checks,
    its skip function, its schedule), its new ``skip_state`` written, and the branch it
    picks run: ``then`` where the window closes, ``otherwise`` elsewhere."""
    multi_steps = run.spec(window.rule).multi_steps
    state = run.state_of(window.rule)
    verdict = multi_steps.window(run.tree(run.updates, window.sel), state,
                                 run.tree(run.params, window.sel))
    keys, spec = _core.flatten(window.rule.state_at.skip_state)
    leaves, found = _core.flatten(verdict.skip_state)
    if found != spec:
        raise ValueError(
            f"{window.rule.where or '<root>'}: MultiSteps' should_skip_update_fn returned a "
            f"skip_state of structure {found}, where the state holds {spec}; the program "
            f"engine steps a state of one structure. Fix: return a skip_state of the "
            f"structure it has at init on every call.")
    for k, v in zip(keys, leaves, strict=True):
        run.state[k] = v
    run.windows[window.out] = (multi_steps, state, verdict)
    _ops(run, op.then if verdict.closes else op.otherwise)


def _accumulate(run: _Run, op: Accumulate) -> None:
    """The mini-step into its window's state, as ``MultiSteps.update`` takes it."""
    multi_steps, state, verdict = run.windows[op.window]
    if verdict.skip:
        return
    at, n = op.rule.state_at, verdict.mini_step
    accs: list[Any] = run.treespec.flatten_up_to(at.acc_grads)  # (flat state indices)
    if verdict.closes:
        for i in op.sel if n > 0 else ():  # (a window of one steps on the updates as they are)
            g = run.updates[i]
            if g is not None:
                run.updates[i] = multi_steps._accumulate(g, run.state[accs[i]], n).to(g.dtype)
                run.clipped.pop(i, None)
        for k in accs:
            acc = run.state[k]
            run.state[k] = None if acc is None else torch.zeros_like(acc)
    else:
        for i in op.sel:
            if run.updates[i] is not None:
                run.state[accs[i]] = multi_steps._accumulate(run.updates[i],
                                                             run.state[accs[i]], n)
    # (the counters as the pure update makes them; its accumulators and inner state are
    # written above and by the inner program)
    counted = verdict.next_state(state, state.acc_grads, state.inner_opt_state)
    run.state[at.mini_step] = counted.mini_step
    run.state[at.gradient_step] = counted.gradient_step


def _record(run: _Run, op: Record) -> None:
    b = run.program.bindings[op.binding]
    values = run.bound(op.binding).values
    run.state[b.count] = _common.safe_increment(run.state[b.count])
    for k, i in b.hyper:
        run.state[i] = values[k]


_STEPS: dict[type, Callable[[_Run, Any], None]] = {
    Map: _map, Reduce: _reduce, Scale: _scale, Gate: _gate, Accumulate: _accumulate,
    Record: _record}


def _ops(run: _Run, ops: tuple[Op, ...]) -> None:
    for op in ops:
        if not isinstance(op, Write):
            _STEPS[type(op)](run, op)


def _apply(run: _Run, donate: bool) -> list[Any]:
    """The params plus the updates: one ``foreach`` add per (device, dtype) group, in
    place when donated (the same additions as ``apply_updates``)."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, (p, u) in enumerate(zip(run.params, run.updates, strict=True)):
        if p is not None and u is not None:
            local = local_tensor(p)
            groups.setdefault((local.device, local.dtype), []).append(i)
    new = list(run.params)
    for idx in groups.values():
        ps = [local_tensor(run.params[i]) for i in idx]
        us = [local_tensor(run.updates[i]) for i in idx]
        if donate:
            torch._foreach_add_(ps, us)
            continue
        for i, out in zip(idx, torch._foreach_add(ps, us), strict=True):
            new[i] = _rewrap_like(run.params[i], out)
    return new


def execute_leaves(program: Program, treespec: _core.TreeSpec, param_leaves: list[Any],
                   grad_leaves: list[Any], state_leaves: list[Any], *, donate: bool = False,
                   group: Any = INFERRED, backends: tuple[str, ...] = ("eager",),
                   ) -> tuple[list[Any], list[Any]]:
    """One step of ``program`` on flat leaves (``treespec``: the params' structure): the
    new params' leaves and the new state's leaves (of the state's structure). ``donate``:
    the params are updated in place and returned. ``group``: the process group the
    reductions are summed over (default: inferred from the DTensor leaves, None for plain
    tensors). ``backends``: the names of the backends offered each segment, in order
    (``functopt/fast/_backends.py``; the last is ``"eager"``)."""
    reason = problem(program, param_leaves)
    if reason is not None:
        raise ValueError(f"the program cannot run: {reason}")
    name = _leaf_names(treespec)
    if group is INFERRED:
        group = _infer_group(param_leaves, name)
    device = next((local_tensor(g).device for g in grad_leaves if g is not None),
                  torch.device("cpu"))
    run = _Run(program, treespec, list(param_leaves), list(grad_leaves), list(state_leaves),
               stats.counted_leaves(grad_leaves, name), group, device, donate=donate,
               backends=_backends.table(backends))
    with torch.no_grad():
        _ops(run, program.ops)
        return _apply(run, donate), run.state


def execute(program: Program, grads: Any, state: Any, params: Any, *, donate: bool = False,
            group: Any = INFERRED) -> tuple[Any, Any]:
    """`execute_leaves` on trees: ``(new_params, new_state)``."""
    param_leaves, treespec = _core.flatten(params)
    grad_leaves = _core.flatten_like(treespec, grads, name="grads", reference="params")
    state_leaves, state_spec = _core.flatten(state)
    values, leaves = execute_leaves(program, treespec, param_leaves, grad_leaves, state_leaves,
                                    donate=donate, group=group)
    return _core.unflatten(treespec, values), _core.unflatten(state_spec, leaves)
