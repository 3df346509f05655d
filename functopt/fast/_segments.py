r"""What the engine's backends share: a program's segments, and the checks of a backend
that writes the params and state itself.

The executor (``functopt/fast/_execute.py``) cuts a program (``functopt/fast/_program.py``)
into *segments*: a run of consecutive `Map` ops, with the leaves they select and the state
they hold (`segments`). The backends (``functopt/fast/_backends.py``: the fused kernels and
the eager reference; ``functopt/fast/_foreach.py``: torch.optim's foreach implementations)
are offered each segment and keep, per program, what they matched of it (`_table`). The
faster ones read a rule inside one ``inject_hyperparams`` on its node built from
placeholders (`_bound_node`) and this step's values (`_hyper_values`), and before they write
check the values' range (`_range_problem`) and, when donated, that nothing they write in
place shares memory (`_donation_problem`).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from functopt._collective.dtensor import _leaf_names, local_tensor
from functopt._spec import PerLeaf, Spec, describe
from functopt.fast._kernels import _PLAIN
from functopt.fast._planner import overlap
from functopt.fast._program import Gate, Map, Op, Program, Resolved, Rule, nodes_of
from functopt.fast._walk import _Walk
from functopt.tree import _core

__all__ = ["Backend", "Leaves", "Segment", "Unclaimed", "segments"]


class Unclaimed(str):
    """A backend's reason for a segment holding no rule of its kind: `explain` gives it,
    the engine does not warn about it (the faster backends' other reasons it does)."""


class Leaves(Protocol):
    """What a backend reads of a step in flight (the executor's run)."""

    program: Program
    treespec: _core.TreeSpec
    params: list[Any]
    updates: list[Any]  # per leaf: its update where the segment stands
    state: list[Any]  # the flat state
    donate: bool
    # per leaf whose update a clip scaled: the sum of squares of the updates it measured
    clipped: dict[int, torch.Tensor]

    def bound(self, index: int) -> Resolved:
        """Binding ``index`` at this step (its values; its inner transform's nodes)."""
        ...


@dataclass(frozen=True, eq=False)
class Segment:
    """A run of consecutive `Map` ops (one with a rule that reduces within a leaf: a part
    of it joined by the leaves its Maps select, `_components`): ``leaves`` (in index
    order) are those they select;
    ``final``: it stands at the top of the program and no op after it reads its leaves'
    updates, so a backend may add them to the params itself."""

    maps: tuple[Map, ...]
    leaves: tuple[int, ...]
    final: bool
    beside: bool = False  # a part of a run with a rule that reduces within a leaf

    @property
    def where(self) -> str:
        """Its rules and their places in the transform, for messages."""
        return ", ".join(f"{_kind(m.rule.spec)} at {m.rule.where or '<root>'}"
                         for m in self.maps)


def _kind(spec: Any) -> str:
    return str(getattr(spec, "kind", type(spec).__name__))


class Backend(Protocol):
    name: str

    def offer(self, segment: Segment, run: Leaves) -> Callable[[], None] | str:
        """The call that runs ``segment`` on ``run``, or the reason this backend does not
        take it (before anything is written)."""
        ...


# --- segments ---------------------------------------------------------------------------

def _sel(op: Op) -> tuple[int, ...]:
    """The leaves whose updates ``op`` reads or writes (every op with a ``sel``)."""
    found: tuple[int, ...] = getattr(op, "sel", ())
    return found


def _components(run: list[Map]) -> list[list[Map]]:
    """A run of Maps split where no leaf joins its parts (a ``partition``'s transforms: each
    part is a segment of its own, which a backend takes or refuses alone), each part in
    program order, the parts in the order of their first Maps."""
    order = {id(m): k for k, m in enumerate(run)}
    parts: list[tuple[set[int], list[Map]]] = []
    for m in run:
        joined = [part for part in parts if part[0].intersection(m.sel)]
        leaves, maps = set(m.sel), [m]
        for part in joined:
            leaves |= part[0]
            maps += part[1]
            parts.remove(part)
        parts.append((leaves, sorted(maps, key=lambda x: order[id(x)])))
    return [maps for _, maps in sorted(parts, key=lambda part: order[id(part[1][0])])]


def _cut(ops: tuple[Op, ...], top: bool) -> list[Segment]:
    found: list[Segment] = []
    run: list[Map] = []

    def close(at: int) -> None:
        # (a run with a rule that reduces within a leaf is cut into its parts: that rule's
        # leaves take the per-leaf backend, the other parts' leaves a faster one; other
        # runs stay whole, one backend call and one range check for all their leaves)
        if not run:
            return
        whole = not any(isinstance(m.rule.spec, PerLeaf) for m in run)
        for maps in [list(run)] if whole else _components(run):
            leaves = tuple(sorted({i for m in maps for i in m.sel}))
            mine = set(leaves)
            final = top and not any(mine.intersection(_sel(later)) for later in ops[at:])
            found.append(Segment(tuple(maps), leaves, final, beside=not whole))
        run.clear()

    for at, op in enumerate(ops):
        if isinstance(op, Map):
            run.append(op)
            continue
        close(at)
        if isinstance(op, Gate):
            found += _cut(op.then, False) + _cut(op.otherwise, False)
    close(len(ops))
    return found


@dataclass(eq=False)
class _Table:
    """What the backends keep per program: its segments, by their first `Map`, each
    backend's structural match per segment, and the refusals not yet warned about."""

    segments: tuple[Segment, ...]
    first: dict[Map, Segment]
    # per backend, its structural match of each segment (what it keeps of it, or a reason)
    matched: dict[tuple[str, Segment], Any] = field(default_factory=dict)
    refused: dict[str, None] = field(default_factory=dict)  # (ordered) since the last warning
    warned: set[str] = field(default_factory=set)
    # per backend and segment: the params and state entries its last call wrote, as
    # id -> (a weak reference, its version), which `_range_problem` does not read again
    written: dict[tuple[str, Segment], dict[int, tuple[Any, int]]] = field(
        default_factory=dict)
    # per backend and segment: the layout its per-leaf and memory checks last passed on
    # (`layout`) and what it built from them
    laid: dict[tuple[str, Segment], tuple[tuple[Any, ...], Any, list[int]]] = field(
        default_factory=dict)


_TABLES: weakref.WeakKeyDictionary[Program, _Table] = weakref.WeakKeyDictionary()


def _table(program: Program) -> _Table:
    found = _TABLES.get(program)
    if found is None:
        cut = tuple(_cut(program.ops, True))
        found = _TABLES[program] = _Table(cut, {s.maps[0]: s for s in cut})
    return found


def segments(program: Program) -> tuple[Segment, ...]:
    """The program's segments, in program order (a `Gate`'s after the ops before it)."""
    return _table(program).segments


def _hyper_values(run: Leaves, bindings: frozenset[int]) -> list[dict[str, Any]]:
    """Per binding of the program, this step's values where the kernels read them (the
    `_Hyper` arguments of a match: ``hyperparams[key]`` of binding ``node``)."""
    return [run.bound(i).values if i in bindings else {}
            for i in range(len(run.program.bindings))]



def _bound_node(walker: _Walk, rule: Rule, run: Leaves, keep: list[Any]) -> Spec | str:
    """A rule inside ``inject_hyperparams`` as the kernels' match reads it: its node in the
    inner transform built from placeholder tensors, which the walk binds to this step's
    values (`_Hyper`); or why it is not matched."""
    assert rule.bound is not None
    index, position = rule.bound
    binding = run.program.bindings[index]
    if binding.parent is not None:
        return (f"{rule.where}: an inject_hyperparams inside another, whose values the "
                f"kernels' match does not bind")
    placeholders = walker.placeholders_of(binding.hyper, index)
    keep.append(placeholders)
    node = nodes_of(describe(binding.spec.build(placeholders)))[position]
    if type(node) is not type(rule.spec):
        return (f"{rule.where}: the injected transform built anew has {node!r} where "
                f"{rule.spec!r} was compiled")
    return node


def _shared(maps: tuple[Map, ...], treespec: _core.TreeSpec) -> set[int]:
    """The flat state entries of the segment's rules that are not per leaf."""
    shared: set[int] = set()
    for m in maps:
        at = m.rule.state_at
        per_leaf = {k for name in m.rule.slots
                    for k in treespec.flatten_up_to(getattr(at, name)) if isinstance(k, int)}
        shared |= {k for k in _core.flatten(at)[0] if isinstance(k, int)} - per_leaf
    return shared


# --- the checks of a backend writing in place ------------------------------------------

def layout(run: Leaves, leaves: tuple[int, ...], entries: list[int]) -> tuple[Any, ...]:
    """What a backend's per-leaf layout checks and memory checks read of the params and
    gradients of ``leaves`` and of the state ``entries``: where each plain tensor's
    elements are and how they are read (a tensor of another type is a new object each
    time: never the same layout), and whether the step is donated. A backend whose
    checks passed on a layout takes it again unchecked (`laid`): every step of a donated
    loop gives the same tensors, and a ``.data`` assignment moves the memory it reads."""
    out: list[Any] = [run.donate]
    for i in leaves:
        p, u = run.params[i], run.updates[i]
        if p is None or u is None:
            out.append(None)
        elif type(p) in _PLAIN and type(u) in _PLAIN:
            out.append((p.data_ptr(), p.dtype, p.stride(), p.shape, p.device,
                        u.dtype, u.shape, u.device))
        else:
            out.append(object())
    for k in entries:
        x = run.state[k]
        out.append((x.data_ptr(), x.dtype, x.stride(), x.shape, x.device)
                   if type(x) in _PLAIN else object())
    return tuple(out)


def matched_of(table: _Table, key: tuple[str, Segment], match: Callable[[], Any]) -> Any:
    """The backend ``key[0]``'s structural match of ``key[1]`` (``match()``, once per
    program)."""
    found = table.matched.get(key)
    if found is None:
        found = table.matched[key] = match()
    return found


def checked_launch(table: _Table, key: tuple[str, Segment], run: Leaves, groups: Any,
                   written: list[tuple[torch.dtype, list[int], list[int]]], checked: bool,
                   reread: bool, launch: Callable[[], None]) -> Callable[[], None] | str:
    """The end of an offer of a backend writing params and state in place (``written``:
    per call, its dtype, its leaves and the flat indices of the state entries it writes):
    the values' range (``reread``: what the last call wrote is read again), the memory
    when donated and the layout not ``checked`` before (`laid`), which is then
    remembered with the backend's ``groups``; the call, which records what it wrote."""
    segment = key[1]
    problem = _range_problem(run, written, None if reread else table.written.get(key))
    if problem is None and run.donate and not checked:
        problem = _donation_problem(run, [i for _, leaves, _ in written for i in leaves],
                                    [k for _, _, ks in written for k in ks],
                                    _leaf_names(run.treespec))
    if problem is not None:
        return problem
    entries = [k for _, _, ks in written for k in ks]
    if not checked:
        table.laid[key] = (layout(run, segment.leaves, entries), groups, entries)

    def call() -> None:
        launch()
        table.written[key] = _versions([run.params[i] for _, leaves, _ in written
                                        for i in leaves] + [run.state[k] for k in entries])

    return call


def laid(table: _Table, key: tuple[str, Segment], run: Leaves, segment: Segment) -> Any:
    """What the backend ``key[0]`` built for ``segment`` the last time its layout and
    memory checks passed, where these tensors have that layout; else None."""
    found = table.laid.get(key)
    if found is None or layout(run, segment.leaves, found[2]) != found[0]:
        return None
    return found[1]

def _range_problem(run: Leaves, groups: list[tuple[torch.dtype, list[int], list[int]]],
                   written: dict[int, tuple[Any, int]] | None = None) -> str | None:
    """Why the kernels' results may not equal the rules' to rounding on these values: an
    element of a gradient, a param or a state entry (per group: its dtype, its leaves, the
    flat indices of its state entries) is not finite, or so large that an intermediate of
    the kernels' arithmetic and not of the rules' overflows (or the reverse: Adam's
    ``(1 - b2) * g * g`` against the rule's ``(1 - b2) * (g * g)``, the kernels'
    ``mu + (1 - b1) * (g - mu)`` against ``b1 * mu + (1 - b1) * g``), both computing in
    float32 (float64 for float64). Each tensor's 2-norm (a bound of its largest element,
    not finite where an element is not) is held to a sixteenth of that dtype's largest
    value, a gradient's to a sixteenth of its root: one foreach pass, one host read.

    ``written``: the params and state entries the segment's last kernel call wrote (see
    `_versions`), not read again while they are the same tensors, unmodified. From values
    within these bounds the kernels write values within them: Adam's moments are convex
    combinations of the old ones and of the gradient (or its square), SGD's trace grows by
    at most the gradient's bound over ``1 - momentum`` per step, and a param moves by the
    learning rate times a ratio bounded by the betas (Adam) or by that trace (SGD), far
    from a sixteenth of the largest value at any learning rate that keeps the pure path
    finite. (A write through ``.data`` does not advance a tensor's version: a param edited
    so in place is not read again.) The foreach rows pass ``written`` where what their
    functions write stays so bounded (moments as convex combinations or maxima, RMSprop's
    momentum by ``1 / sqrt(1 - alpha)`` per step, Rprop's step sizes clamped), and not for
    Adagrad's sum of squares or Adadelta's squared deltas, which may grow at each step.

    An update a clip scaled (``run.clipped``) is not read: the sum of squares the clip
    measured, over updates of which it is one, bounds its norm (``clip_by_global_norm``
    scales by at most 1), and is held to the square of its bound. Where that sum is beyond
    it (the clip's updates may still be in range), the updates are read as the others."""
    if _in_range(run, groups, written, bounded=True):
        return None
    if any(i in run.clipped for _, leaves, _ in groups for i in leaves) and _in_range(
            run, groups, written, bounded=False):
        return None
    return ("an element of a gradient, param or state entry is not finite or beyond the "
            "kernels' range (where their arithmetic and the rules' overflow apart)")


def _in_range(run: Leaves, groups: list[tuple[torch.dtype, list[int], list[int]]],
              written: dict[int, tuple[Any, int]] | None, bounded: bool) -> bool:
    """`_range_problem`'s check in one host read (``bounded``: the clips' sums of squares
    for the updates they scaled)."""
    checks = []
    for dtype, leaves, entries in groups:
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        largest = torch.finfo(wide).max
        kept = [run.params[i] for i in leaves] + [run.state[k] for k in entries]
        if written:
            kept = [x for x in kept if not _unchanged(x, written)]
        sums = {id(s): s for i in leaves if bounded and (s := run.clipped.get(i)) is not None}
        checks += [(s <= largest / 256).cpu() for s in sums.values()]
        updates = [run.updates[i] for i in leaves if not (bounded and i in run.clipped)]
        for tensors, bound in ((updates, math.sqrt(largest) / 16), (kept, largest / 16)):
            tensors = [x for x in map(local_tensor, tensors) if x.numel()]
            if tensors:
                norms = torch._foreach_norm(tensors, 2, dtype=wide)
                checks.append((torch.stack(norms).max() <= bound).cpu())
    return not checks or bool(torch.stack(checks).all())


def _versions(tensors: list[Any]) -> dict[int, tuple[Any, int]]:
    """The tensors a kernel call wrote, by id: a weak reference and the version."""
    return {id(x): (weakref.ref(x), x._version) for x in tensors if isinstance(x, torch.Tensor)}


def _unchanged(x: Any, written: dict[int, tuple[Any, int]]) -> bool:
    found = written.get(id(x))
    return found is not None and found[0]() is x and found[1] == x._version


def _donation_problem(run: Leaves, leaves: list[int], entries: list[int],
                      name: Callable[[int], str]) -> str | None:
    """Why the kernels may not write these donated params (leaf indices) and state entries
    (flat indices) in place: two of them share memory."""
    # (what each tensor is, named only for a message: the paths cost a tree walk)
    written = [("param", i) for i in leaves] + [("state", k) for k in entries]

    def named(j: int) -> str:
        kind, at = written[j]
        return f"param {name(at)!r}" if kind == "param" else f"state entry {at}"

    pair = overlap([run.params[at] if kind == "param" else run.state[at]
                    for kind, at in written], named, "tensor")
    if pair is None:
        return None
    return (f"{named(pair[0])} and {named(pair[1])} share memory, which the kernels would "
            f"write in place")

