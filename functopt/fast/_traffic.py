"""The memory traffic of a fast step: the bytes each group of leaves reads and writes.

An optimizer step does a few arithmetic operations per byte it moves, so on an accelerator
its time is the bytes it moves divided by the memory bandwidth. ``explain`` reports the
count per group and per param; it is counted, not measured:

- from the plan for the groups PyTorch's kernels and the compiled tier step: the tensors
  each kernel or compiled call reads and writes (params, gradients, each state slot), and
  every copy the step makes on the way (gradients copied because the kernel unscales them
  in place, copies of values and state a step that does not donate must not write, the
  compiled tier's gathers into one buffer and its copies back, layout copies), plus the
  norm and finiteness passes of folded clips and guards;
- by running the step's eager operations on meta tensors (no data, no arithmetic) under
  a dispatch mode that adds up the tensors each operation reads and writes, for the pure
  path and the per-leaf tier, whose rules are plain PyTorch code.

Only tensors of at least one dimension are counted: 0-d tensors (step counts, learning
rates, a leaf's norm) are a few bytes per leaf, not per param. A clip is counted as a step
that clips (the CPU leaves a clip whose factor is exactly 1 out of the kernel call: fewer
bytes). An operation is counted as reading each tensor it takes and writing each tensor it
returns or mutates, except that a copy, a fill and an ``out=`` argument only write their
destination, and a view or an allocation moves nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from functopt._collective.dtensor import local_tensor
from functopt.fast import _compiled as _tier
from functopt.fast._layout import end_to_end

__all__ = ["Traffic", "group_traffic", "mixed_traffic", "pass_traffic", "perleaf_traffic",
           "pure_traffic"]


@dataclass(frozen=True)
class Traffic:
    """Bytes read and written by one step (of a group, a pass, or the whole step)."""

    read: int = 0
    written: int = 0

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.read + other.read, self.written + other.written)

    @property
    def total(self) -> int:
        return self.read + self.written


_NONE = Traffic()


def _copy(size: int) -> Traffic:
    """A copy of ``size`` bytes: read once and written once."""
    return Traffic(size, size)

# operations that write a destination without reading it
_WRITE_ONLY = frozenset({
    "aten::copy_", "aten::_foreach_copy_", "aten::fill_", "aten::_foreach_fill_",
    "aten::zero_", "aten::_foreach_zero_", "aten::_copy_from", "aten::_copy_from_and_resize",
})


# PyTorch's fused optimizer kernels: they write their gradients (unscaled) only when given
# a grad_scale, whatever their schema declares
_UNSCALING = frozenset({"aten::_fused_adam_", "aten::_fused_adamw_", "aten::_fused_sgd_",
                        "aten::_fused_adagrad_"})

# operations that allocate a tensor without reading or writing any data
_ALLOCATIONS = frozenset({"aten::empty", "aten::empty_like", "aten::new_empty",
                          "aten::empty_strided", "aten::new_empty_strided"})

# operations that return their input's memory under another shape, without declaring it
_ALIASES = frozenset({"aten::_unsafe_view", "aten::_reshape_alias", "aten::lift_fresh"})


def _bytes(x: Any) -> int:
    """The counted bytes of a tensor, or of a list of tensors."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size() if x.dim() else 0
    if isinstance(x, (list, tuple)):
        return sum(_bytes(t) for t in x)
    return 0


class _Counter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Adds up the bytes each dispatched operation reads and writes (see the module)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.read = 0
        self.written = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view or func._schema.name in _ALIASES or func._schema.name in _ALLOCATIONS:
            return out
        schema = func._schema
        write_only = schema.name in _WRITE_ONLY
        unscaled = schema.name in _UNSCALING and kwargs.get("grad_scale") is None
        for k, arg in enumerate(schema.arguments):
            value = args[k] if k < len(args) else kwargs.get(arg.name)
            size = _bytes(value)
            if not size:
                continue
            mutated = arg.alias_info is not None and arg.alias_info.is_write and not (
                unscaled and arg.name == "grads")
            if mutated:
                self.written += size
            if not mutated or not (write_only or arg.name == "out"):
                self.read += size
        returns = out if len(schema.returns) > 1 else (out,)
        for ret, value in zip(schema.returns, returns, strict=False):
            if ret.alias_info is None:  # a new tensor (mutated arguments are counted above)
                self.written += _bytes(value)
        return out


def _counted(run: Any) -> Traffic | str:
    """The traffic of ``run()`` (on meta tensors), or why it could not be counted."""
    counter = _Counter()
    try:
        with counter:
            run()
    except Exception as e:  # a rule that reads a value (.item()) has no meta run
        return f"{type(e).__name__}: {e}".splitlines()[0][:200]
    return Traffic(counter.read, counter.written)


def _leaf(x: Any) -> torch.Tensor:
    return local_tensor(x)


def pass_traffic(structure: Any, grads: list[Any]) -> Traffic:
    """The norm pass of the folded clips and the finiteness pass of the folded guards:
    each reads every gradient it measures (``_collective.stats.clip_sums``: unless every
    clip measures a float64 leaf, a pass over every counted gradient, which on an
    accelerator reads each again in float64 to rescue overflowed float32 norms; the
    members of the clips that measure one, in float64)."""
    read = 0
    present = [i for i, g in enumerate(grads) if g is not None and _leaf(g).numel()]
    if structure.clips:
        widened = [any(grads[j] is not None and _leaf(grads[j]).dtype == torch.float64
                       for j in leaves) for leaves in structure.clips]
        if not all(widened):
            read += sum(_bytes(_leaf(grads[i])) * (1 + (_leaf(grads[i]).device.type != "cpu"))
                        for i in present)
        wide = {i for leaves, w in zip(structure.clips, widened, strict=True) if w
                for i in leaves}
        read += sum(_bytes(_leaf(grads[i])) for i in present if i in wide)
    if structure.guards:
        read += sum(_bytes(_leaf(grads[i])) for i in present)
    return Traffic(read, 0)


def group_traffic(group: Any, values: list[Any], grads: list[Any], state_leaves: list[Any],
                  *, scaled: bool, donate: bool, donate_grads: bool) -> Traffic:
    """The bytes one kernel or compiled group moves per step; ``scaled``: its gradients are
    multiplied first (a folded clip's factor)."""
    kind = group.plan.kernel
    if kind == "zero":
        return _NONE
    if kind == "compiled":
        return _compiled(group, values, grads, state_leaves, donate)
    ps = [_leaf(values[i]) for i in group.leaves]
    gs = [_leaf(grads[i]) for i in group.leaves]
    slots = _kernel_slots(group, state_leaves)
    state = sum(_bytes(column) for column in slots)
    # without donation the values and state are copied, the kernel writes the copies
    total = _NONE if donate else _copy(_bytes(ps) + state)
    widened = scaled and group.dtype == torch.float64
    for g, p in zip(gs, ps, strict=True):
        # a gradient laid out unlike its value, or one the kernel scales and the caller
        # keeps, is copied; a float64 group multiplies its copies by the factor itself
        if (g.stride() != p.stride() and p.numel() > 1) or (scaled and not donate_grads):
            total += _copy(_bytes(g))
        if widened:
            total += _copy(_bytes(g))
    return total + Traffic(_bytes(ps) + _bytes(gs) + state,
                           _bytes(ps) + state + (_bytes(gs) if scaled and not widened else 0))


def _kernel_slots(group: Any, state_leaves: list[Any]) -> list[list[torch.Tensor]]:
    """The state columns one kernel call reads and writes."""
    plan = group.plan
    names: list[tuple[str, str]] = []
    if plan.kernel in ("adamw", "adam"):
        names = [("adam", "mu"), ("adam", "nu")]
        if plan.adam.kernel == "amsgrad":
            names.append(("adam", "nu_max"))
    elif plan.trace is not None:
        names = [("trace", "trace")]
    return [[_leaf(state_leaves[k]) for k in group.slots(op, slot)] for op, slot in names]


def _compiled(group: Any, values: list[Any], grads: list[Any], state_leaves: list[Any],
              donate: bool) -> Traffic:
    """A compiled group: the gathers into one buffer per tensor kind, the one compiled call
    (reads the gradients, values and slots, writes values and slots) and the copies back."""
    keep = [j for j, i in enumerate(group.leaves) if _leaf(values[i]).numel()]
    if not keep:
        return _NONE
    idx = [group.leaves[j] for j in keep]
    ps = [_leaf(values[i]) for i in idx]
    gs = [_leaf(grads[i]) for i in idx]
    relaid = [g for g, p in zip(gs, ps, strict=True)
              if g.stride() != p.stride() and p.numel() > 1]  # copied into the value's layout
    total = _copy(_bytes(relaid))
    if (len(gs) > 1) if relaid else end_to_end(gs) is None:  # gathered into one buffer
        total += _copy(_bytes(gs))
    columns = [ps]
    for j, op in enumerate(group.plan.ops):
        for name in op.slots:
            columns.append([_leaf(state_leaves[group.plans[jj].ops[j].slots[name]])
                            for jj in keep])
    for column in columns:
        size = _bytes(column)
        laid_out = end_to_end(column) is not None
        if not (laid_out and donate):  # gathered (or cloned) into a buffer
            total += _copy(size)
        if donate and not laid_out:  # and copied back
            total += _copy(size)
        total += _copy(size)  # the call reads and writes it
    return total + Traffic(_bytes(gs), 0)


def _meta(x: Any) -> Any:
    """A meta tensor laid out as ``x`` (its local shard), other leaves as they are."""
    if not isinstance(x, torch.Tensor):
        return x
    t = _leaf(x)
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def pure_traffic(tx: Any, params: Any, state: Any, grads: list[Any], *,
                 donate: bool) -> Traffic | str:
    """The pure path of a fast step on meta tensors: ``tx.update``, then the updates added
    with one ``foreach`` add per (device, dtype) group (in place when donated); or why it
    could not be counted."""
    from functopt.fast import _step  # (the step's own apply)
    from functopt.tree import _core

    leaves, treespec = _core.flatten(params)
    if any(type(x) is not torch.Tensor for x in leaves if isinstance(x, torch.Tensor)):
        return "the params are not plain tensors (a DTensor, say)"
    p_leaves = [_meta(x) for x in leaves]
    p = _core.unflatten(treespec, p_leaves)
    s_leaves, s_spec = _core.flatten(state)
    s = _core.unflatten(s_spec, [_meta(x) for x in s_leaves])
    g = _core.unflatten(treespec, [_meta(x) for x in grads])

    def run() -> None:
        updates, _ = tx.update(g, s, p)
        _step._grouped_apply(p_leaves, treespec, updates, donate)

    return _counted(run)


def perleaf_traffic(groups: list[tuple[Any, bool]], values: list[Any], grads: list[Any],
                    state_leaves: list[Any], treespec: Any, *,
                    donate: bool) -> Traffic | str:
    """The per-leaf tier's groups (each with whether a folded clip scales its gradients)
    on meta tensors: their rules' own updates and the ``foreach`` apply; or why they could
    not be counted."""
    from functopt.fast import _perleaf

    if any(op.rebuild is not None for g, _ in groups for op in g.plan.ops):
        return "a rule inside inject_hyperparams (its rule is built at each step)"
    vs = [_meta(x) for x in values]
    gs = [_meta(x) for x in grads]
    ss = [_meta(x) for x in state_leaves]
    one = torch.ones((), dtype=torch.float64, device="meta")

    def run() -> None:
        _perleaf.run_groups([(g, one if scaled else None, None) for g, scaled in groups],
                            vs, gs, ss, list(vs),
                            list(ss), treespec=treespec, donate=donate, env=None)

    return _counted(run)


def mixed_traffic(lowered: Any, params: list[Any], views: list[Any], grads: list[Any],
                  state_leaves: list[Any], *, multiplied: bool, count_zeros: bool,
                  donate: bool, stores: list[Any], treespec: Any,
                  ) -> tuple[dict[int, Traffic], Traffic | str]:
    """The mixed-precision step on the planner's groups (``functopt/precision/_fused.py``):
    per group (by index) and for the whole step, or why the step's could not be counted.

    ``views``: the values the groups update (the masters, or the params that are their own);
    ``stores``: per leaf, its master or None; ``multiplied``: the kernels unscale or clip
    (a loss scale or ``max_grad_norm``). The step's passes: each gradient cast to its
    value's dtype (read the gradient, write the cast) unless its compiled group's call
    reads it as given, one read of every cast (or gradient so read) for the statistics
    (and of the gradients as given for the zero count), the groups on them, then each
    param written from its new master (read the master, write the param), which the
    compiled tier's call does itself."""
    present = [i for i, (g, v) in enumerate(zip(grads, views, strict=True))
               if g is not None and v is not None]
    given = _tier.given_reads(lowered, grads, views)
    compiled = {i for group in lowered.groups if group.plan.kernel == "compiled"
                for i in group.leaves}
    wide: list[Any] = [None] * len(grads)
    total = _NONE
    for i in present:
        g, v = _leaf(grads[i]), _leaf(views[i])
        if g.dtype == v.dtype or i in given:
            wide[i] = g
            continue
        total = total + Traffic(_bytes(g), g.numel() * v.element_size() if g.dim() else 0)
        wide[i] = torch.empty(g.shape, dtype=v.dtype, device="meta")
    if donate:
        _flat_casts(lowered, grads, views, wide, given)
    total = total + Traffic(sum(_bytes(wide[i]) for i in present), 0)  # the statistics
    if count_zeros:
        total = total + Traffic(sum(_bytes(_leaf(grads[i])) for i in present), 0)
    clipped = multiplied or bool(lowered.structure.clips)
    for i in present:  # a gradient the caller keeps, which a kernel would scale: copied
        if wide[i] is _leaf(grads[i]) and clipped and i not in compiled:
            total = total + _copy(_bytes(wide[i]))
    traffic: dict[int, Traffic] = {}
    perleaf = []
    written: set[int] = set()
    for k, g in enumerate(lowered.groups):
        scaled = multiplied or g.plan.clip is not None
        if g.plan.kernel == "perleaf":
            perleaf.append((g, scaled))
            continue
        traffic[k] = group_traffic(g, views, wide, state_leaves, scaled=scaled,
                                   donate=donate, donate_grads=True)
        if g.plan.kernel == "compiled":
            low = _compiled_low(g, params, stores, views, donate)
            if low is not None:
                traffic[k] = traffic[k] + low
                written.update(g.leaves)
        total = total + traffic[k]
    for i in present:  # the params from their new masters
        if stores[i] is not None and i not in written:
            total = total + Traffic(_bytes(_leaf(views[i])), _bytes(_leaf(params[i])))
    if not perleaf:
        return traffic, total
    eager = perleaf_traffic(perleaf, views, wide, state_leaves, treespec, donate=donate)
    return traffic, eager if isinstance(eager, str) else total + eager


def _flat_casts(lowered: Any, grads: list[Any], views: list[Any], wide: list[Any],
                given: set[int]) -> None:
    """Lay the casts of each compiled group whose gradients all need one end to end in
    ``wide`` (meta views of one buffer), as a donated step does (precision's `_flat_casts`)."""
    for group in lowered.groups:
        idx = [i for i in group.leaves if wide[i] is not None and wide[i].numel()]
        if group.plan.kernel == "compiled" and idx and not (given & set(idx)) and all(
                wide[i] is not _leaf(grads[i]) for i in idx):
            flat = torch.empty(sum(wide[i].numel() for i in idx), dtype=wide[idx[0]].dtype,
                               device="meta")
            for i, view in zip(idx, _tier._scatter(flat, [_leaf(views[i]) for i in idx]),
                               strict=True):
                wide[i] = view


def _compiled_low(group: Any, params: list[Any], stores: list[Any], views: list[Any],
                  donate: bool) -> Traffic | None:
    """The low-precision params a compiled group's call writes itself (when the compiled
    tier's `_lows` says it does), or None where the step writes them after it."""
    idx = [i for i in group.leaves if _leaf(views[i]).numel()]
    if not idx:
        return None
    low = [p if s is not None else None for p, s in zip(params, stores, strict=True)]
    lows = _tier._lows(low, idx, [_leaf(views[i]) for i in idx])
    if lows is None:
        return None
    size = _bytes(lows)
    if donate and end_to_end(lows) is None:  # written into one buffer, then copied out
        return Traffic(size, 2 * size)
    return Traffic(0, size)
