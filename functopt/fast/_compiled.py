r"""The planner's compiled tier: elementwise rules without a PyTorch kernel, compiled.

A group of leaves whose programs are the same chain of elementwise rules (Lion, NAdam,
RAdam, Adamax, Adadelta, Rprop, SGD with dampening, Adam variants the kernels lack, with
decay, learning rates, schedules, a leading clip or ``apply_if_finite``) runs as one call of
a ``torch.compile``\ d function over *flat* tensors: the group's gradients, values and
per-leaf state entries, each laid end to end in memory order. The function runs each rule's
own pure ``update`` on those flat tensors (elementwise, so the same numbers as leaf by leaf)
and writes the results in place, which Inductor fuses into one loop per group.

What is flat costs nothing: state that [`make_step(...).init`][functopt.fast.make_step]
allocated (each state entry of a group is a view into one buffer, while the state tree the
user sees stays per leaf), params that are views of one contiguous buffer. What is not
flat is gathered with one ``torch.cat`` before the call and written back with one
``foreach`` copy after: correct for any layout, and the reason to allocate the state flat.

**Scalars are computed once per call.** Inductor fuses a 0-d intermediate (Adam's bias
corrections ``1 - b1 ** count`` in float64, a schedule's value, a clip's factor) into
the loop that reads it, where it is computed again for every vector of elements: a
float64 ``pow`` per 8 elements made compiled Adam several times slower than the kernel.
The tier compiles through `_backend`, which marks each computed 0-d value that a
tensor with elements reads (`_hoist_scalars`): Inductor then computes those values in one
small kernel before the loops, which only load them. The values are the same operations
on the same inputs, so the results do not change.

One compiled function per group, built at the group's first step (seconds; Inductor's cache
makes later processes faster) and recompiled only when the group's sizes change. It holds
no tensor between calls: every buffer it writes belongs to the caller's params or state.

A rule whose update also sums over all its leaves (Prodigy, D-Adaptation: a spec with
``sums`` and ``finish``) takes two compiled calls per group: `group_sums` (the rules up to
it, then its first half, writing nothing), whose results the planner adds over the groups
and ranks, and the group's step, where the rule runs its second half with those sums.
"""

from __future__ import annotations

import itertools
import types
import warnings
from typing import Any

import optree
import torch

from functopt._collective.dtensor import _rewrap_like, local_tensor
from functopt.fast import _layout
from functopt.fast._errors import FastPathWarning
from functopt.fast._layout import dense, end_to_end, memory_view, shaped_like
from functopt.transforms import _common
from functopt.tree import _core

__all__ = ["entries_problem", "flat_layout", "group_sums", "lay_out_params", "layout_problem",
           "run_group"]

_GROUPS = itertools.count()  # names the compiled function of each group


@torch.library.custom_op("functopt::hoisted", mutates_args=())
def _hoisted(x: torch.Tensor) -> torch.Tensor:
    """``x`` unchanged: a 0-d value the compiled step computes once, before its loops (see
    `_hoist_scalars`). Inductor lowers it to a stored buffer (`_lowering`); elsewhere it is
    a copy."""
    return x.clone()


@_hoisted.register_fake
def _hoisted_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


_LOWERED: list[bool] = []  # whether Inductor lowers functopt::hoisted (decided once)


def _lowering() -> bool:
    """Register Inductor's lowering of ``functopt::hoisted`` (once): store the value, then
    read it back, which costs a load in the loops and no call at run time. Inductor's
    lowering registry is not public API; if it moved, the tier does not hoist, with a
    warning, and its results are the same."""
    if not _LOWERED:
        try:
            from torch._inductor import lowering

            def hoisted(x: Any) -> Any:
                x.realize()
                return lowering.clone(x)

            lowering.register_lowering(torch.ops.functopt.hoisted)(hoisted)
            _LOWERED.append(True)
        except (ImportError, AttributeError, TypeError) as error:
            warnings.warn(
                f"the compiled tier cannot register its Inductor lowering ({error!r}) in "
                f"torch {torch.__version__}: scalars such as Adam's bias corrections are "
                f"computed for every element again (slower, same results)",
                FastPathWarning, stacklevel=3)
            _LOWERED.append(False)
    return _LOWERED[0]


def _scalar(node: Any) -> bool:
    value = node.meta.get("example_value")
    return isinstance(value, torch.Tensor) and value.dim() == 0


def _computed(node: Any) -> bool:
    """A node that computes a new value (not an input, not an in-place write)."""
    if node.op == "call_method":
        return not str(node.target).endswith("_")
    if node.op == "call_function":
        return not getattr(node.target, "__name__", "").endswith("_")
    return False


def _hoist_scalars(graph: Any) -> int:
    """Route every computed 0-d value of ``graph`` (a Dynamo FX graph) that a tensor with
    elements reads through ``functopt::hoisted``; the number of values so marked. A 0-d
    value read only by other 0-d values is left alone: it is part of a marked one's
    computation, or of no loop."""
    marked = 0
    for node in list(graph.nodes):
        if not (_computed(node) and _scalar(node)):
            continue
        readers = [u for u in node.users if isinstance(u.meta.get("example_value"),
                                                       torch.Tensor) and not _scalar(u)]
        if not readers:
            continue
        with graph.inserting_after(node):
            stored = graph.call_function(torch.ops.functopt.hoisted.default, (node,))
        stored.meta["example_value"] = node.meta["example_value"]
        for reader in readers:
            reader.replace_input_with(node, stored)
        marked += 1
    return marked


def _backend(gm: Any, example_inputs: Any) -> Any:
    """Inductor, after `_hoist_scalars` (when Inductor lowers the mark)."""
    from torch._inductor.compile_fx import compile_fx
    if _lowering() and _hoist_scalars(gm.graph):
        gm.graph.lint()
        gm.recompile()
    return compile_fx(gm, example_inputs)


def _compile(fn: Any) -> Any:
    return torch.compile(fn, backend=_backend, dynamic=False)


def layout_problem(plan: Any, local: torch.Tensor, state_leaves: list[Any]) -> str | None:
    """Why a leaf cannot join a compiled group, or None: its value and per-leaf state must
    be dense, of one shape and one stride pattern (their dtypes may differ)."""
    if not local.is_floating_point():
        return f"{local.dtype} is not a floating dtype"
    if not dense(local):
        return f"its layout (strides {local.stride()}) is not dense"
    return entries_problem(plan.ops, local, state_leaves, same_dtype=False)


def entries_problem(ops: Any, local: torch.Tensor, state_leaves: list[Any], *,
                    same_dtype: bool) -> str | None:
    """Why the per-leaf state entries of ``ops`` cannot be read linearly beside the value
    ``local`` (a leaf's local shard), or None: each a tensor on its device, of its shape
    and strides, and with ``same_dtype`` (the PyTorch kernels) of its dtype."""
    for op in ops:
        for slot, k in op.slots.items():
            s = state_leaves[k]
            if not isinstance(s, torch.Tensor):
                return f"its {op.kind} state.{slot} is {_core._describe(s)}"
            ls = local_tensor(s)
            if ls.device != local.device:
                return (f"its {op.kind} state.{slot} is on {ls.device}, the param on "
                        f"{local.device}")
            if (same_dtype and ls.dtype != local.dtype) or ls.shape != local.shape:
                return (f"its {op.kind} state.{slot} is {_core._describe(ls)} for a "
                        f"{_core._describe(local)}" + (
                            " (the kernels need one dtype per leaf)" if same_dtype else ""))
            if not _layout.same_strides(ls, local) and local.numel() > 1:
                return (f"its {op.kind} state.{slot} has strides {ls.stride()}, the param "
                        f"{local.stride()}")
    return None


def _gather(tensors: list[torch.Tensor], writable: bool, workspace: dict[Any, Any] | None,
            key: Any) -> tuple[torch.Tensor, bool]:
    """One flat tensor over ``tensors`` and whether it is a view of them (writes reach
    them). ``writable`` False: a view is copied, so that the call writes into nothing of the
    caller's. A gathered copy is written into ``workspace[key]`` when a workspace is given
    (scratch kept by the caller: a fresh buffer of this size costs more than the copy)."""
    flat = end_to_end(tensors)
    if flat is not None:
        return (flat, True) if writable else (flat.clone(), False)
    views = [memory_view(t) for t in tensors]
    if workspace is None:
        return torch.cat(views), False
    buffer = _buffer(workspace, key, sum(t.numel() for t in tensors), tensors[0].dtype,
                     tensors[0].device)
    return torch.cat(views, out=buffer), False


def _buffer(workspace: dict[Any, Any] | None, key: Any, total: int, dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    """A 1-d scratch tensor of ``total`` elements: ``workspace[key]`` when it fits (kept
    for the next step), else a new one."""
    buffer = None if workspace is None else workspace.get(key)
    if buffer is None or buffer.numel() != total or buffer.dtype != dtype or (
            buffer.device != device):
        buffer = torch.empty(total, dtype=dtype, device=device)
        if workspace is not None:
            workspace[key] = buffer
    return buffer


def _scatter(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors shaped and strided like ``like``, viewing consecutive segments of ``flat``."""
    out, start = [], 0
    for t in like:
        out.append(shaped_like(flat, start, t))
        start += t.numel()
    return out


def _body(ops: tuple[Any, ...]) -> Any:
    """The function compiled for one group: the rules' pure updates over flat tensors,
    written into them in place; returns the new shared state entries of each rule.

    The updates come in as an argument (each rule's own, or for a rule inside
    ``inject_hyperparams`` the one built from this step's values): Dynamo guards a closure
    by its code and the shapes of the tensors it holds, so a rebuilt update with new
    hyperparameter values runs the same graph."""
    def step(g: torch.Tensor, p: torch.Tensor, slots: list[torch.Tensor],
             shared: list[dict[str, Any]], scale: torch.Tensor | None,
             skip: torch.Tensor | None, low: torch.Tensor | None,
             updates: list[Any], totals: list[Any]) -> list[dict[str, Any]]:
        u = _widened(g, p, scale)
        new_slots: list[torch.Tensor] = []
        new_shared: list[dict[str, Any]] = []
        k = 0
        for op, own, update, total in zip(ops, shared, updates, totals, strict=True):
            fields = dict(own)
            for name in op.slots:
                fields[name] = slots[k]
                k += 1
            state = type(op.state_at)(**fields)
            # a rule with tree sums: its second half, given the sums over every leaf
            u, new = update(u, state, p) if op.finish is None else op.finish(u, state, p,
                                                                            total)
            new_slots.extend(getattr(new, name) for name in op.slots)
            new_shared.append({f: getattr(new, f) for f in own})
        new_p = p + u
        if skip is not None:
            new_p = torch.where(skip, p, new_p)
            new_slots = [torch.where(skip, old, new) for old, new in
                         zip(slots, new_slots, strict=True)]
            new_shared = [{f: optree.tree_map(lambda a, b: torch.where(skip, a, b), own[f],
                                              new[f]) for f in own}
                          for own, new in zip(shared, new_shared, strict=True)]
        p.copy_(new_p)
        if low is not None:  # a mixed step's params: their masters rounded to nearest
            low.copy_(new_p)
        for old, new in zip(slots, new_slots, strict=True):
            old.copy_(new)
        return new_shared
    return _own_code(step)


def _sums_body(ops: tuple[Any, ...]) -> Any:
    """The function compiled for one group's tree sums: the rules up to the first with tree
    sums (see ``Leafwise.sums``), then that rule's first half; writes nothing."""
    def sums(g: torch.Tensor, p: torch.Tensor, slots: list[torch.Tensor],
             shared: list[dict[str, Any]], scale: torch.Tensor | None) -> Any:
        u = _widened(g, p, scale)
        k = 0
        for op, own in zip(ops, shared, strict=True):
            fields = dict(own)
            for name in op.slots:
                fields[name] = slots[k]
                k += 1
            state = type(op.state_at)(**fields)
            if op.sums is not None:
                return op.sums(u, state, p)
            u, _ = op.fn(u, state, p)
        raise AssertionError("a group without a rule with tree sums")
    return _own_code(sums)


def _widened(g: torch.Tensor, p: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """The gradients a group's rules take: in the values' dtype (a mixed step's
    low-precision gradients, which its call reads as given: `reads_as_given`), times
    ``scale``."""
    if g.dtype != p.dtype:
        g = g.to(p.dtype)
    return g if scale is None else _common.scaled(g, scale)


# Whether a mixed step's compiled call reads low-precision gradients as given on the CPU
# too. There Inductor's bfloat16 loads make the call about twice as slow as a cast first
# (20M params in one leaf, two threads of an AVX2 CPU: Lion 124 ms against 60 ms, AdamW
# 144 against 65), so the CPU casts; on an accelerator, where the step is bound by memory,
# reading them as given saves 8 of its bytes per param. (On for tests of that path.)
READ_GIVEN_ON_CPU = False


def reads_as_given(group: Any, grads: list[Any], values: list[Any]) -> bool:
    """Whether a compiled group's call reads a mixed step's gradients as they are given,
    casting them to the values' (the masters') dtype itself: every gradient of the group
    is of one dtype, another than its value's, off the CPU (`READ_GIVEN_ON_CPU`): one pass
    over the low-precision gradients instead of a cast written and read again."""
    if group.plan.kernel != "compiled":
        return False
    present = [i for i in group.leaves if grads[i] is not None and values[i] is not None]
    dtypes = {(local_tensor(grads[i]).dtype, local_tensor(values[i]).dtype) for i in present}
    if len(dtypes) != 1 or len({d for pair in dtypes for d in pair}) != 2:
        return False
    return READ_GIVEN_ON_CPU or all(local_tensor(values[i]).device.type != "cpu"
                                    for i in present)


def given_reads(lowered: Any, grads: list[Any], values: list[Any]) -> set[int]:
    """The leaves whose compiled group's call reads a mixed step's gradients as given
    (`reads_as_given`)."""
    return {i for group in lowered.groups if reads_as_given(group, grads, values)
            for i in group.leaves}


def _own_code(fn: Any) -> Any:
    # A code object of its own per group: Dynamo keeps its compiled graphs per code object,
    # with a limit of recompiles (8 by default) past which it runs the function uncompiled;
    # one code object shared by every group of every transform would reach it.
    code = fn.__code__.replace(co_name=f"compiled_group_{next(_GROUPS)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__,
                              fn.__closure__)


def run_group(group: Any, values: list[Any], grads: list[Any], state_leaves: list[Any],
              new_values: list[Any], new_leaves: list[Any], updates: list[Any], *,
              donate: bool,
              scale: torch.Tensor | None, found_inf: torch.Tensor | None,
              compiled: dict[Any, Any], workspace: dict[Any, Any] | None = None,
              totals: dict[int, Any] | None = None,
              low: list[Any] | None = None, new_low: list[Any] | None = None) -> None:
    """One compiled call for ``group`` (see the module docstring); ``compiled`` holds the
    compiled functions by group (the structure's, so that a plan compiles once); ``updates``
    the update of each rule of the group's plan (see `_body`);
    ``workspace`` the caller's scratch buffers for the gathered copies (a donating step's,
    kept per thread), or None to allocate them; ``totals`` the tree sums (over every group
    and rank, from `group_sums`) of the group's rules that have them, by rule. ``low`` (per
    leaf, a mixed step's low-precision param or None): when every leaf of the group has
    one, of one dtype, the call also writes them, their new values rounded, into
    ``new_low`` (in place when donated)."""
    plan = group.plan
    keep = [j for j, i in enumerate(group.leaves) if local_tensor(values[i]).numel()]
    if not keep:
        _run_empty(group, values, grads, state_leaves, new_leaves, updates, scale=scale,
                   found_inf=found_inf, totals=totals)
        return
    idx = [group.leaves[j] for j in keep]
    ps = [local_tensor(values[i]) for i in idx]
    gs = [_in_layout(local_tensor(grads[i]), p) for i, p in zip(idx, ps, strict=True)]
    key = plan.key()
    g_flat, _ = _gather(gs, True, workspace, (key, "grads"))
    p_flat, p_view = _gather(ps, donate, workspace, (key, "values"))
    slot_sets: list[tuple[list[int], list[torch.Tensor]]] = []
    slot_flats: list[tuple[torch.Tensor, bool]] = []
    for at, ks in _columns(plan, [group.plans[j] for j in keep]):
        tensors = [local_tensor(state_leaves[k]) for k in ks]
        slot_sets.append((ks, tensors))
        slot_flats.append(_gather(tensors, donate, workspace, (key, *at)))
    shared = _shared_of(plan, state_leaves)
    lows = _lows(low, idx, ps)
    low_flat, low_view = None, False
    if lows is not None:
        low_flat = end_to_end(lows) if donate else None
        low_view = low_flat is not None
        if low_flat is None:  # written whole by the call: no gather needed
            total = sum(t.numel() for t in lows)
            low_flat = _buffer(workspace if donate else None, (key, "low"), total,
                               lows[0].dtype, lows[0].device)
    fn = compiled.get(key)
    if fn is None:
        fn = compiled[key] = _compile(_body(plan.ops))
    skip = None if found_inf is None else found_inf.to(device=p_flat.device, dtype=torch.bool)
    new_shared = fn(g_flat, p_flat, [flat for flat, _ in slot_flats], shared, scale, skip,
                    low_flat, updates, _totals_of(plan, totals))
    if low is not None and lows is not None and low_flat is not None and new_low is not None:
        _written(low_flat, low_view, lows, idx, low, new_low, donate)
        if donate:
            for i in idx:
                new_low[i] = low[i]
    _written(p_flat, p_view, ps, idx, values, new_values, donate)
    for (ks, tensors), (flat, view) in zip(slot_sets, slot_flats, strict=True):
        _written(flat, view, tensors, ks, state_leaves, new_leaves, donate)
    _write_shared(plan, new_shared, new_leaves)


def _run_empty(group: Any, values: list[Any], grads: list[Any], state_leaves: list[Any],
               new_leaves: list[Any], updates: list[Any], *, scale: torch.Tensor | None,
               found_inf: torch.Tensor | None, totals: dict[int, Any] | None) -> None:
    """`run_group` on a rank that holds no elements of the group: nothing to compute,
    their state is empty. But the rules' shared state (a count of their own, Prodigy's
    estimate) moves on every rank: the body over no elements moves it (uncompiled: no
    graph for that)."""
    plan = group.plan
    shared = _shared_of(plan, state_leaves)
    if any(shared):
        empty = _empties(group, values, grads, state_leaves)
        skip = None if found_inf is None else found_inf.to(dtype=torch.bool)
        _write_shared(plan, _body(plan.ops)(*empty, shared, scale, skip, None, updates,
                                            _totals_of(plan, totals)), new_leaves)


def _columns(plan: Any, plans: list[Any]) -> list[tuple[tuple[int, str], list[int]]]:
    """Per per-leaf state entry of the group's rules, (its rule's position in ``plan``,
    its field) and its flat state indices over ``plans`` (the leaves' own plans)."""
    return [((j, name), [leaf_plan.ops[j].slots[name] for leaf_plan in plans])
            for j, op in enumerate(plan.ops) for name in op.slots]


def _written(flat: torch.Tensor, view: bool, tensors: list[torch.Tensor], indices: list[int],
             given: list[Any], out: list[Any], donate: bool) -> None:
    """A call's results ``flat`` back where they belong: when donated, in ``tensors`` (the
    local tensors of ``given[k]``, ``k`` in ``indices``: a copy unless ``flat`` is a
    ``view`` of them), else as ``out[k]``, new tensors wrapped as ``given[k]``."""
    if donate:
        if not view:
            torch._foreach_copy_(tensors, _scatter(flat, tensors))
        return
    for k, new in zip(indices, _scatter(flat, tensors), strict=True):
        out[k] = _rewrap_like(given[k], new)


def _shared_of(plan: Any, state_leaves: list[Any]) -> list[dict[str, Any]]:
    """Per rule, its state fields that are not per leaf (counts, scalars), as values."""
    return [{f: optree.tree_map(lambda k: state_leaves[k], getattr(op.state_at, f))
             for f in op.state_at._fields if f not in op.slots} for op in plan.ops]


def _write_shared(plan: Any, new_shared: list[dict[str, Any]], new_leaves: list[Any]) -> None:
    counters = {op.count for op in plan.ops if op.count is not None}
    for op, own in zip(plan.ops, new_shared, strict=True):
        for f, value in own.items():
            index_tree = getattr(op.state_at, f)
            for k, v in zip(optree.tree_leaves(index_tree), optree.tree_leaves(value),
                            strict=True):
                if k not in counters:  # the planner advances the counts, once per step
                    new_leaves[k] = v


def _lows(low: list[Any] | None, idx: list[int], values: list[torch.Tensor],
          ) -> list[torch.Tensor] | None:
    """The local low-precision params of a group's leaves when the call can write them all
    (every leaf has one, of one dtype, laid out as its value), else None: the caller then
    rounds them itself."""
    if low is None or any(low[i] is None for i in idx):
        return None
    lows = [local_tensor(low[i]) for i in idx]
    if len({t.dtype for t in lows}) != 1 or any(
            t.stride() != v.stride() and v.numel() > 1 for t, v in zip(lows, values, strict=True)):
        return None
    return lows


def _totals_of(plan: Any, totals: dict[int, Any] | None) -> list[Any]:
    return [None if op.finish is None else (totals or {})[op.node] for op in plan.ops]


def _empties(group: Any, values: list[Any], grads: list[Any],
             state_leaves: list[Any]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Gradient, value and per-leaf state entries of no elements, in the dtypes of the
    group's first leaf: a body's input when this rank holds nothing of the group."""
    i, leaf_plan = group.leaves[0], group.plans[0]

    def empty(x: Any) -> torch.Tensor:
        return local_tensor(x).reshape(-1)[:0]

    return empty(grads[i]), empty(values[i]), [
        empty(state_leaves[op.slots[name]]) for op in leaf_plan.ops for name in op.slots]


def group_sums(group: Any, values: list[Any], grads: list[Any], state_leaves: list[Any],
               counted: list[bool], *, scale: torch.Tensor | None,
               compiled: dict[Any, Any]) -> Any:
    """This process's tree sums of the group's rule with tree sums (a tuple of 0-d
    tensors), over the leaves of the group with elements that this rank counts (a
    replicated shard counts on one rank): one compiled call over them laid end to end,
    which writes nothing of the caller's."""
    plan = group.plan
    keep = [j for j, i in enumerate(group.leaves)
            if counted[i] and local_tensor(values[i]).numel()]
    shared = _shared_of(plan, state_leaves)
    if not keep:
        # nothing to sum here: the rule's own first half over no elements gives its zeros,
        # which a sum over ranks still needs (uncompiled: no graph for that)
        g_empty, p_empty, slots_empty = _empties(group, values, grads, state_leaves)
        return _sums_body(plan.ops)(g_empty, p_empty, slots_empty, shared, scale)
    idx = [group.leaves[j] for j in keep]

    def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
        return _gather(tensors, True, None, None)[0]

    ps = [local_tensor(values[i]) for i in idx]
    g_flat = flat([_in_layout(local_tensor(grads[i]), p) for i, p in zip(idx, ps, strict=True)])
    p_flat = flat(ps)
    slot_flats = [flat([local_tensor(state_leaves[k]) for k in ks])
                  for _, ks in _columns(plan, [group.plans[j] for j in keep])]
    key = (plan.key(), "sums")
    fn = compiled.get(key)
    if fn is None:
        fn = compiled[key] = _compile(_sums_body(plan.ops))
    return fn(g_flat, p_flat, slot_flats, shared, scale)


def _in_layout(g: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``g`` in the layout of its param ``p`` (a copy where their strides differ)."""
    if g.stride() != p.stride() and p.numel() > 1:
        return torch.empty_like(p, dtype=g.dtype).copy_(g)
    return g


def flat_layout(values: list[Any], movable: list[bool], state_leaves: list[Any],
                groups: list[Any]) -> tuple[list[Any], list[Any]]:
    """``values`` and ``state_leaves`` with each compiled group's per-leaf state entries,
    and its values where ``movable`` (a mixed step's masters; never a caller's params),
    moved into one buffer per entry (views keep each leaf's shape and strides, values
    equal): what the compiled tier then reads and writes in place."""
    out_values, out_leaves = list(values), list(state_leaves)
    for group in groups:
        if group.plan.kernel != "compiled":
            continue
        idx = [i for i in group.leaves if local_tensor(values[i]).numel()]
        if idx and all(movable[i] for i in idx):
            _lay_end_to_end(idx, values, out_values)
        plans = [leaf_plan for leaf_plan, i in zip(group.plans, group.leaves, strict=True)
                 if local_tensor(values[i]).numel()]
        for _, ks in _columns(group.plan, plans):
            _lay_end_to_end(ks, state_leaves, out_leaves)
    return out_values, out_leaves


def _lay_end_to_end(indices: list[int], tensors: list[Any], out: list[Any]) -> None:
    local = [local_tensor(tensors[k]) for k in indices]
    if not local or end_to_end(local) is not None:
        return
    flat = torch.cat([memory_view(t) for t in local])
    for k, view in zip(indices, _scatter(flat, local), strict=True):
        out[k] = _rewrap_like(tensors[k], view)


def lay_out_params(values: list[Any], groups: list[Any], name: Any) -> int:
    """Move each compiled group's params, and their ``.grad``, into one buffer each: every
    param keeps its identity, shape, strides and values (``param.data`` becomes a view of
    the group's buffer), and its ``.grad`` a view of the group's gradient buffer (zeros
    where it had none), which autograd then accumulates into in place. Returns the
    number of groups laid out."""
    laid = 0
    for group in groups:
        if group.plan.kernel != "compiled":
            continue
        idx = [i for i in group.leaves if values[i].numel()]
        if not idx:
            continue
        tensors = [values[i] for i in idx]
        for i, t in zip(idx, tensors, strict=True):
            if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
                raise TypeError(
                    f"lay_out: param {name(i)!r} is a {type(t).__name__}; the layout moves "
                    f"plain tensors and nn.Parameters (a DTensor's local shard belongs to "
                    f"its sharding). Fix: call lay_out on unsharded params only.")
            if not t.is_leaf:
                raise ValueError(
                    f"lay_out: param {name(i)!r} is not a leaf tensor (it was computed from "
                    f"others), so its storage cannot be moved. Fix: pass the model's "
                    f"parameters (dict(model.named_parameters())).")
        if end_to_end(tensors) is None:
            flat = torch.cat([memory_view(t.detach()) for t in tensors])
            for t, view in zip(tensors, _scatter(flat, tensors), strict=True):
                t.data = view
        grads = [t.grad for t in tensors]
        laid += 1
        if all(g is not None and g.stride() == t.stride()
               for g, t in zip(grads, tensors, strict=True)) and end_to_end(grads) is not None:
            continue  # laid out already
        flat_grad = torch.zeros(sum(t.numel() for t in tensors), dtype=tensors[0].dtype,
                                device=tensors[0].device)
        for t, g, view in zip(tensors, grads, _scatter(flat_grad, tensors), strict=True):
            if g is not None:
                view.copy_(g)
            t.grad = view
    return laid

