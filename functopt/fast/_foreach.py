r"""The engine's ``"foreach"`` backend: torch.optim's foreach implementations of the
optimizers that have no fused kernel, for the leaves whose rules are their
``functopt.optim`` chains.

One table of rows (`ROWS`), one per function (``torch.optim.<module>._multi_tensor_<name>``);
each row knows its function, how to match a leaf's rules in a segment (its matcher: the
function's keyword arguments, bound to numbers or to this step's injected values, and the
state lists it passes, or the reason the rules are not the function's), the values it
refuses at a step, and which lists are scratch (the rule's count as torch's
``state_steps``, a shared state entry copied per leaf). One offer and one launch serve every
row. A row takes a leaf only where the function computes the rules as they compute them:

- every row: float32 and float64 plain tensors (not a DTensor or a subclass) whose gradient
  and state entries have the param's dtype, shape and device (the rules compute a narrow
  dtype's state in float32 and round once; the functions round at each op); the rule's
  numbers Python numbers or the values of one ``inject_hyperparams`` (read on the host at
  each step, as the kernel backend reads them: a ``param_groups`` edit of a drop-in reaches
  the function); an optional ``scale(-1)`` first (torch's ``maximize``), an L2
  ``add_decayed_weights`` before the rule (torch's ``weight_decay``), and the rule's learning
  rate last (``scale_by_learning_rate`` of a number); the values' range and, donated, the
  memory checks the kernel backend makes (``functopt/fast/_segments.py``);
- RMSprop (``_multi_tensor_rmsprop``): ``scale_by_rms(eps_in_sqrt=False,
  bias_correction=False)``, an optional ``trace`` (decay > 0 at each step, not Nesterov,
  the param's dtype: torch's momentum), not centered; an ``eps`` whose reciprocal is finite
  in the dtype (the rule multiplies by ``1 / (sqrt(nu) + eps)``, the function divides by
  ``sqrt(nu) + eps``);
- Adamax (``_multi_tensor_adamax``): ``scale_by_adamax``;
- NAdam (``_multi_tensor_nadam``): ``scale_by_nadam``, with L2 decay or decoupled decay (an
  ``add_decayed_weights`` after the rule: torch's ``decoupled_weight_decay``); its
  ``mu_products`` are per-leaf copies of the rule's float64 ``mu_product``, the state's
  written from the function's (torch.optim keeps it in the default dtype: float32 unless
  that is float64);
- RAdam (``_multi_tensor_radam``): ``scale_by_radam(eps_before_correction=True)`` with
  ``eps_root=0``, a threshold of 5, not Nesterov, L2 or decoupled decay, an ``eps`` above 0
  (the function's unrectified step is a nan where ``sqrt(nu) + eps`` is 0, the rule's the
  momentum); refused at a step whose ``rho_t`` is exactly 5 (the function rectifies above
  5, the rule from 5);
- Adadelta (``_multi_tensor_adadelta``): ``scale_by_adadelta``;
- Rprop (``_multi_tensor_rprop``): ``scale_by_rprop`` then ``scale(-1)`` (its learning rate
  is the step sizes' initial value, in the state), no decay;
- Adagrad (``_multi_tensor_adagrad``): ``scale_by_rss(eps_in_sqrt=False)`` and the learning
  rate ``functopt.optim``'s Adagrad schedules, ``learning_rate / (1 + count * lr_decay)`` of
  the schedule's own count, read from that schedule (any other schedule is refused: its
  value is not read exactly), and an ``eps`` above 0 (where a sum is 0 the rule's update
  is 0, the function's ``0 / 0``).

Torch's ``state_steps`` are incremented inside the functions: each row passes scratch step
tensors (float64, holding the rule's count: exact where torch.optim's float32 steps are
below 2**24) and keeps the rule's own count in the state, advanced once per step. The
functions round as torch.optim does: a leaf equals ``torch.optim.<name>(foreach=True)``
bitwise and the pure path within the fast-path tolerance (tests/laws/test_foreach.py).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from functopt._collective.dtensor import _leaf_names
from functopt._spec import Leafwise, Spec
from functopt.fast._kernels import _PLAIN
from functopt.fast._program import Map
from functopt.fast._programs import _Const, _Env, _Hyper
from functopt.fast._segments import (
    Backend,
    Leaves,
    Segment,
    Unclaimed,
    _bound_node,
    _hyper_values,
    _kind,
    _shared,
    _table,
    checked_launch,
    laid,
    matched_of,
)
from functopt.fast._walk import _Walk
from functopt.transforms import _common
from functopt.tree import _core

__all__ = ["FOREACH", "ROWS"]

_DTYPES = (torch.float32, torch.float64)
_FLAGS = {"differentiable": False, "capturable": False, "has_complex": False}

# A list the function takes after the gradients, per leaf: ("entry", k) its state entry k
# (written back), ("empty", None) an empty list, ("copy", k) a copy of the shared entry k
# (the first leaf's written back), ("steps", k) scratch steps holding count k (None: 0)
_List = tuple[str, int | None]


@dataclass(eq=False)
class _Match:
    """What a matcher found of a leaf's rules: the function's keyword arguments (numbers
    as `_Const` or `_Hyper` bindings; ``flags`` fixed), the lists after the gradients,
    and the checks of this step's values (``checks``: name -> (test, reason))."""

    numbers: dict[str, Any] = field(default_factory=dict)
    flags: dict[str, Any] = field(default_factory=dict)
    lists: list[_List] = field(default_factory=list)
    checks: dict[str, tuple[Callable[[float], bool], str]] = field(default_factory=dict)
    count: int | None = None  # the rule's count, whose value the steps hold
    l2: bool = False  # an add_decayed_weights before the rule


@dataclass(frozen=True, eq=False)
class _Leaf:
    """One leaf's rules as a row's function computes them."""

    row: _Row
    maps: tuple[Map, ...]  # the segment's Maps on the leaf (leaves with the same: one call)
    match: _Match


class _Rules:
    """A leaf's rules in a segment, in order (``identity`` left out): each its kind, its
    arguments bound (`_Const`, or `_Hyper` for an injected value) and its state's indices."""

    def __init__(self, found: list[tuple[str, dict[str, Any], Any]], treespec: _core.TreeSpec,
                 leaf: int) -> None:
        self.found, self.treespec, self.leaf = found, treespec, leaf

    def take(self, kind: str) -> tuple[dict[str, Any], Any] | None:
        """The arguments and state indices of the next rule if it is a ``kind`` (taken)."""
        if not self.found or self.found[0][0] != kind:
            return None
        _, args, at = self.found.pop(0)
        return args, at

    def entry(self, index_tree: Any) -> int:
        """A per-leaf state entry's flat index, from its field's index tree."""
        found = self.treespec.flatten_up_to(index_tree)[self.leaf]
        assert isinstance(found, int)
        return found

    def rest(self) -> str | None:
        return None if not self.found else f"{self.found[0][0]} after the learning rate"


def _static(binding: Any) -> Any:
    """A fixed argument's value (an injected one: a marker no test takes)."""
    return binding.value if isinstance(binding, _Const) else _Hyper


def _number(m: _Match, name: str, binding: Any, what: str) -> str | None:
    """``binding`` as the function's argument ``name``, or why it is not a number."""
    value = binding.value if isinstance(binding, _Const) else None
    if isinstance(binding, _Const) and not (
            isinstance(value, (int, float)) and not isinstance(value, bool)):
        return f"{what} is {value!r}, which the function takes as a Python number"
    m.numbers[name] = _Const(float(binding.value)) if isinstance(binding, _Const) else binding
    return None


def _check(m: _Match, name: str, binding: Any, what: str, test: Callable[[float], bool],
           reason: str) -> str | None:
    """A number the function does not take but the rules must have (``test``)."""
    problem = _number(m, f"_{name}", binding, what)
    if problem is None:
        m.checks[f"_{name}"] = (test, reason)
    return problem


def _prefix(r: _Rules, m: _Match, decay: bool = True) -> str | None:
    """``[scale(-1)]`` (torch's maximize) and, with ``decay``, ``[add_decayed_weights]``
    (torch's L2 ``weight_decay``) before the rule."""
    m.flags["maximize"] = False
    if (found := r.take("scale")) is not None:
        m.flags["maximize"] = True
        problem = _check(m, "maximize", found[0]["step_size"], "scale's step_size",
                         lambda x: x == -1.0, "a scale other than scale(-1.0) (torch's "
                         "maximize) before the rule")
        if problem is not None:
            return problem
    if decay:
        m.numbers["weight_decay"] = _Const(0.0)
        if (found := r.take("add_decayed_weights")) is not None:
            m.l2 = True
            return _number(m, "weight_decay", found[0]["weight_decay"],
                           "add_decayed_weights' weight_decay")
    return None


def _decoupled(r: _Rules, m: _Match) -> str | None:
    """``[add_decayed_weights]`` after the rule: torch's ``decoupled_weight_decay`` (with
    no L2 decay before it)."""
    m.flags["decoupled_weight_decay"] = False
    if (found := r.take("add_decayed_weights")) is None:
        return None
    if m.l2:
        return "add_decayed_weights both before and after the rule"
    m.flags["decoupled_weight_decay"] = True
    return _number(m, "weight_decay", found[0]["weight_decay"],
                   "add_decayed_weights' weight_decay")


def _learning_rate(r: _Rules, m: _Match) -> str | None:
    found = r.take("scale_by_learning_rate")
    if found is None or _static(found[0]["flip_sign"]) is not True:
        return "it does not end with scale_by_learning_rate (flip_sign=True)"
    return _number(m, "lr", found[0]["learning_rate"], "the learning rate") or r.rest()


def _first(*problems: Callable[[], str | None]) -> str | None:
    for problem in problems:
        found = problem()
        if found is not None:
            return found
    return None


# --- the rows' matchers -------------------------------------------------------------------

def _rmsprop(r: _Rules, m: _Match) -> str | None:
    if (problem := _prefix(r, m)) is not None:
        return problem
    if (found := r.take("scale_by_rms")) is None:
        return "its rules are not [scale(-1)], [add_decayed_weights], scale_by_rms, ..."
    h, at = found
    if _static(h["eps_in_sqrt"]) is not False or _static(h["bias_correction"]) is not False:
        return "scale_by_rms with eps_in_sqrt=True or bias_correction=True is not torch's"
    m.flags["centered"] = False
    m.lists += [("entry", r.entry(at.nu)), ("empty", None)]
    m.numbers["momentum"] = _Const(0.0)
    if (traced := r.take("trace")) is not None:
        t, t_at = traced
        if _static(t["nesterov"]) is not False or _static(t["accumulator_dtype"]) is not None:
            return ("a trace other than trace(decay > 0) in the param's dtype (torch's "
                    "momentum) after scale_by_rms")
        problem = _number(m, "momentum", t["decay"], "trace's decay")
        if problem is not None:
            return problem
        m.checks["momentum"] = (lambda x: x > 0, "a trace(decay=0), which torch's momentum=0 "
                                "does not keep")
        m.lists.append(("entry", r.entry(t_at.trace)))
    else:
        m.lists.append(("empty", None))
    m.lists.append(("steps", None))
    return _first(lambda: _number(m, "alpha", h["decay"], "scale_by_rms' decay"),
                  lambda: _number(m, "eps", h["eps"], "scale_by_rms' eps"),
                  lambda: _learning_rate(r, m))


def _moments(r: _Rules, m: _Match, kind: str, names: tuple[str, ...],
             ) -> tuple[dict[str, Any], Any] | str:
    """The prefix and the rule ``kind`` of Adam's moments (``b1``, ``b2``, ``eps`` as
    torch's ``names``), its ``mu`` and ``nu`` the first lists."""
    if (problem := _prefix(r, m)) is not None:
        return problem
    if (found := r.take(kind)) is None:
        return f"its rules are not [scale(-1)], [add_decayed_weights], {kind}, ..."
    h, at = found
    for name, key in zip(names, ("b1", "b2", "eps"), strict=True):
        if (problem := _number(m, name, h[key], f"{kind}'s {key}")) is not None:
            return problem
    m.lists += [("entry", r.entry(at.mu)), ("entry", r.entry(at.nu))]
    m.count = at.count
    return found


def _adamax(r: _Rules, m: _Match) -> str | None:
    found = _moments(r, m, "scale_by_adamax", ("beta1", "beta2", "eps"))
    if isinstance(found, str):
        return found
    m.lists.append(("steps", m.count))
    return _learning_rate(r, m)


def _nadam(r: _Rules, m: _Match) -> str | None:
    found = _moments(r, m, "scale_by_nadam", ("beta1", "beta2", "eps"))
    if isinstance(found, str):
        return found
    h, at = found
    m.lists += [("copy", at.mu_product), ("steps", m.count)]
    return _first(lambda: _number(m, "momentum_decay", h["momentum_decay"],
                                  "scale_by_nadam's momentum_decay"),
                  lambda: _decoupled(r, m), lambda: _learning_rate(r, m))


def _radam(r: _Rules, m: _Match) -> str | None:
    found = _moments(r, m, "scale_by_radam", ("beta1", "beta2", "eps"))
    if isinstance(found, str):
        return found
    h, _ = found
    if _static(h["nesterov"]) is not False or _static(h["eps_before_correction"]) is not True:
        return "scale_by_radam with nesterov=True or eps_before_correction=False is not torch's"
    m.lists.append(("steps", m.count))
    # (before it rectifies, the function divides sqrt(nu) + eps by 0 and takes the
    # reciprocal: a nan where both are 0, where the rule takes the momentum alone)
    m.checks["eps"] = (lambda x: x > 0, "an eps of 0, whose nan where a second moment is 0 "
                       "the function's unrectified steps take and the rule's do not")
    return _first(
        lambda: _check(m, "eps_root", h["eps_root"], "scale_by_radam's eps_root",
                       lambda x: x == 0.0, "scale_by_radam with eps_root > 0 is not torch's"),
        lambda: _check(m, "threshold", h["threshold"], "scale_by_radam's threshold",
                       lambda x: x == 5.0, "scale_by_radam with a threshold other than 5 "
                       "is not torch's"),
        lambda: _decoupled(r, m), lambda: _learning_rate(r, m))


def _adadelta(r: _Rules, m: _Match) -> str | None:
    if (problem := _prefix(r, m)) is not None:
        return problem
    if (found := r.take("scale_by_adadelta")) is None:
        return "its rules are not [scale(-1)], [add_decayed_weights], scale_by_adadelta, ..."
    h, at = found
    m.lists += [("entry", r.entry(at.e_g)), ("entry", r.entry(at.e_x)), ("steps", None)]
    return _first(lambda: _number(m, "rho", h["rho"], "scale_by_adadelta's rho"),
                  lambda: _number(m, "eps", h["eps"], "scale_by_adadelta's eps"),
                  lambda: _learning_rate(r, m))


def _rprop(r: _Rules, m: _Match) -> str | None:
    if (problem := _prefix(r, m, decay=False)) is not None:
        return problem
    if (found := r.take("scale_by_rprop")) is None:
        return "its rules are not [scale(-1)], scale_by_rprop, scale(-1)"
    h, at = found
    m.lists += [("entry", r.entry(at.prev_updates)), ("entry", r.entry(at.step_sizes)),
                ("steps", None)]
    last = r.take("scale")
    if last is None:
        return "scale_by_rprop not followed by scale(-1.0)"
    return _first(
        lambda: _number(m, "etaminus", h["eta_minus"], "scale_by_rprop's eta_minus"),
        lambda: _number(m, "etaplus", h["eta_plus"], "scale_by_rprop's eta_plus"),
        lambda: _number(m, "step_size_min", h["min_step_size"], "its min_step_size"),
        lambda: _number(m, "step_size_max", h["max_step_size"], "its max_step_size"),
        lambda: _check(m, "descent", last[0]["step_size"], "the last scale's step_size",
                       lambda x: x == -1.0, "scale_by_rprop not followed by scale(-1.0)"),
        r.rest)


def _adagrad_schedule(fn: Any) -> dict[str, Any] | None:
    """``learning_rate`` and ``lr_decay`` of ``functopt.optim``'s Adagrad schedule (the
    function ``_chains.adagrad`` makes), or None for any other callable."""
    code = getattr(fn, "__code__", None)
    if code is None or code.co_qualname != "adagrad.<locals>.decayed" or (
            fn.__module__ != "functopt.optim._chains" or fn.__closure__ is None):
        return None
    return dict(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__), strict=True))


def _adagrad(r: _Rules, m: _Match) -> str | None:
    if (problem := _prefix(r, m)) is not None:
        return problem
    if (found := r.take("scale_by_rss")) is None:
        return "its rules are not [scale(-1)], [add_decayed_weights], scale_by_rss, ..."
    h, at = found
    if _static(h["eps_in_sqrt"]) is not False:
        return "scale_by_rss with eps_in_sqrt=True is not torch's"
    lr = r.take("scale_by_learning_rate")
    closed = None if lr is None else lr[0].get("learning_rate:closure")
    if lr is None or closed is None or _static(lr[0]["flip_sign"]) is not True:
        return ("its learning rate is not functopt.optim.Adagrad's schedule "
                "(learning_rate / (1 + count * lr_decay)), whose values the function reads")
    m.count = lr[1].count
    m.lists += [("entry", r.entry(at.sum_of_squares)), ("steps", m.count),
                ("none", None), ("none", None)]
    m.flags["has_sparse_grad"] = False
    # (the rule's update is 0 where a sum is 0; the function's 0 / (0 + eps))
    m.checks["eps"] = (lambda x: x > 0, "an eps of 0, where the function divides 0 by 0 "
                       "for a sum of 0 and the rule gives 0")
    return _first(lambda: _number(m, "eps", h["eps"], "scale_by_rss' eps"),
                  lambda: _number(m, "lr", closed["learning_rate"], "the learning rate"),
                  lambda: _number(m, "lr_decay", closed["lr_decay"], "its lr_decay"),
                  r.rest)


# --- the table ----------------------------------------------------------------------------

def _eps_reciprocal(values: dict[str, float], dtype: torch.dtype, step: float) -> str | None:
    # (the rule multiplies by 1 / (sqrt(nu) + eps), the function divides by sqrt(nu) + eps:
    # they agree on what is finite where 1 / eps is)
    if values["eps"] * torch.finfo(dtype).max <= 1:
        return f"an eps of {values['eps']} whose reciprocal overflows {dtype}"
    return None


def _rho_five(values: dict[str, float], dtype: torch.dtype, step: float) -> str | None:
    b2 = values["beta2"]
    rho_inf = 2 / (1 - b2) - 1
    if rho_inf - 2 * step * (b2 ** step) / (1 - b2 ** step) == 5:
        return "rho_t is 5 at this step (the function rectifies above 5, the rule from 5)"
    return None


@dataclass(frozen=True, eq=False)
class _Row:
    """torch.optim's ``name`` as its foreach function ``module._multi_tensor_<module>``
    computes it: the kind of its rule, its matcher, the values it refuses at a step
    (``problem``: of this step's arguments, the dtype and the step's number), its flags,
    and whether what it writes stays within the range check's bounds (`_range_problem`:
    not read again while unchanged)."""

    name: str
    kind: str
    module: str
    matcher: Callable[[_Rules, _Match], str | None]
    problem: Callable[[dict[str, float], torch.dtype, float], str | None] | None = None
    flags: dict[str, Any] = field(default_factory=lambda: dict(_FLAGS))
    bounded: bool = True

    def function(self) -> Callable[..., None]:
        found: Callable[..., None] = getattr(importlib.import_module(
            f"torch.optim.{self.module}"), f"_multi_tensor_{self.module}")
        return found


ROWS: tuple[_Row, ...] = (
    _Row("RMSprop", "scale_by_rms", "rmsprop", _rmsprop, _eps_reciprocal),
    _Row("Adamax", "scale_by_adamax", "adamax", _adamax),
    _Row("NAdam", "scale_by_nadam", "nadam", _nadam),
    _Row("RAdam", "scale_by_radam", "radam", _radam, _rho_five),
    # (a sum of squares, and Adadelta's squared deltas, may grow at each step: what the
    # function wrote is read again at every step)
    _Row("Adadelta", "scale_by_adadelta", "adadelta", _adadelta, bounded=False),
    _Row("Rprop", "scale_by_rprop", "rprop", _rprop),
    _Row("Adagrad", "scale_by_rss", "adagrad", _adagrad,
         flags={"differentiable": False, "has_complex": False}, bounded=False),
)
_BY_KIND = {row.kind: row for row in ROWS}


# --- the match, the offer and the launch --------------------------------------------------

@dataclass(frozen=True, eq=False)
class _Matched:
    """A segment's leaves as a row computes them, the counts they advance and the shared
    entries they write, and the bindings their values read."""

    row: _Row
    leaves: dict[int, _Leaf]
    counts: tuple[int, ...]
    bindings: frozenset[int]
    copied: frozenset[int]  # the shared entries the function writes per leaf


def _bound_args(segment: Segment, run: Leaves) -> dict[Map, dict[str, Any]] | str:
    """Per Map of ``segment``, its rule's arguments bound (an injected value: `_Hyper`)."""
    walker = _Walk(None, run.treespec, run.params, run.state)
    keep: list[Any] = []  # (the placeholders, alive while the walk binds their ids)
    found: dict[Map, dict[str, Any]] = {}
    for m in segment.maps:
        spec: Spec | str = m.rule.spec
        if m.rule.bound is not None:
            spec = _bound_node(walker, m.rule, run, keep)
            if isinstance(spec, str):
                return spec
        if m.totals is not None or not isinstance(spec, Leafwise):
            return f"{m.rule.where or '<root>'}: {_kind(spec)} is no rule of one leaf"
        found[m] = {k: walker.bind(v) for k, v in spec.hyper.items()}
        for k, v in spec.hyper.items():
            closed = _adagrad_schedule(v)
            if closed is not None:  # (its values, bound as the rule's own arguments)
                found[m][f"{k}:closure"] = {n: walker.bind(x) for n, x in closed.items()}
    return found


def _match(segment: Segment, run: Leaves) -> _Matched | str:
    """The foreach backend's structural match of ``segment``, or the reason it has none."""
    rows = list(dict.fromkeys(_BY_KIND[k] for k in map(_kind, (m.rule.spec for m in segment.maps))
                              if k in _BY_KIND))
    if not rows:
        return Unclaimed(f"none of its rules is one of torch.optim's foreach "
                         f"implementations ({', '.join(row.name for row in ROWS)})")
    if len(rows) > 1:
        return f"the rules of several of torch.optim's classes ({sorted(r.name for r in rows)})"
    row = rows[0]
    what = f"torch.optim's foreach {row.name}"
    if not segment.final:
        return f"its updates are read after it, and {what} writes the params"
    args = _bound_args(segment, run)
    if isinstance(args, str):
        return args
    name = _leaf_names(run.treespec)
    leaves: dict[int, _Leaf] = {}
    for i in segment.leaves:
        maps = tuple(m for m in segment.maps if i in m.sel)
        rules = _Rules([(_kind(m.rule.spec), args[m], m.rule.state_at) for m in maps
                        if _kind(m.rule.spec) != "identity"], run.treespec, i)
        found = _Match()
        problem = row.matcher(rules, found)
        if problem is not None:
            return f"leaf {name(i)!r}: {problem} ({what})"
        leaves[i] = _Leaf(row, maps, found)
    counts = {m.rule.state_at.count for m in segment.maps
              if "count" in getattr(m.rule.state_at, "_fields", ())}
    copied = {k for leaf in leaves.values() for kind, k in leaf.match.lists
              if kind == "copy" and k is not None}
    if _shared(segment.maps, run.treespec) - counts - copied:
        return f"{segment.where}: a rule keeps shared state that {what} does not write"
    bindings = frozenset(m.rule.bound[0] for m in segment.maps if m.rule.bound is not None)
    return _Matched(row, leaves, tuple(sorted(counts)), bindings, frozenset(copied))


def _copies_problem(row: Any, copied: Any, state: list[Any]) -> str | None:
    """Why the shared state entries ``copied`` (written at each step: checked at each) are
    not what the function takes per leaf, copied: a float64 scalar."""
    for k in copied:
        x = state[k]
        if type(x) not in _PLAIN or x.dtype != torch.float64 or x.dim():
            return f"its {row.kind}'s shared state entry is not a float64 scalar"
    return None


def _leaf_problem(leaf: _Leaf, p: Any, u: Any, state: list[Any]) -> str | None:
    """Why the row's function cannot take this leaf as the rules compute it."""
    what = f"torch's foreach {leaf.row.name}"
    if type(p) not in _PLAIN or type(u) not in _PLAIN:
        return f"{what} takes plain tensors (not a DTensor or a subclass)"
    if p.dtype not in _DTYPES:
        return f"{what} rounds {p.dtype} at each op, the rules once"
    problem = _copies_problem(leaf.row, {k for kind, k in leaf.match.lists
                                         if kind == "copy" and k is not None}, state)
    if problem is not None:
        return problem
    entries = [state[k] for kind, k in leaf.match.lists if kind == "entry" and k is not None]
    for x in (u, *entries):
        if type(x) not in _PLAIN or x.dtype != p.dtype or x.shape != p.shape or (
                x.device != p.device):
            return "its gradient or state entries differ from the param in dtype or shape"
    return None


def _grouped(matched: _Matched, segment: Segment, run: Leaves,
             before: dict[Any, list[int]] | None) -> dict[Any, list[int]] | str:
    """The leaves of ``segment`` with an update, by call (device, dtype and rules), or the
    first leaf's reason the function cannot take it; ``before``: the groups of a layout
    checked before (`laid`), whose shared entries only are checked again."""
    if before is not None:
        return _copies_problem(matched.row, matched.copied, run.state) or before
    groups: dict[Any, list[int]] = {}
    for i in segment.leaves:
        p, u = run.params[i], run.updates[i]
        if p is None or u is None:
            continue
        leaf = matched.leaves[i]
        problem = _leaf_problem(leaf, p, u, run.state)
        if problem is not None:
            return f"leaf {_leaf_names(run.treespec)(i)!r}: {problem}"
        groups.setdefault((p.device, p.dtype, leaf.maps), []).append(i)
    return groups


class _Foreach:
    """torch.optim's foreach implementations (see the module docstring)."""

    name = "foreach"

    def offer(self, segment: Segment, run: Leaves) -> Callable[[], None] | str:
        table, key = _table(run.program), ("foreach", segment)
        matched = matched_of(table, key, lambda: _match(segment, run))
        if isinstance(matched, str):
            return matched
        name = _leaf_names(run.treespec)
        before = laid(table, key, run, segment)
        checked = before is not None
        groups = _grouped(matched, segment, run, before)
        if isinstance(groups, str):
            return groups
        if not groups and matched.copied:
            return (f"no leaf has a gradient, and {matched.row.kind}'s shared state advances "
                    f"without one (the function writes it per leaf)")
        env = _Env(run.state, _hyper_values(run, matched.bindings))
        calls: list[tuple[list[_Leaf], list[int], dict[str, Any]]] = []
        steps: dict[int | None, float] = {None: 0.0}
        for leaves in groups.values():
            leaf = matched.leaves[leaves[0]]
            c = leaf.match.count
            if c is not None and c not in steps and leaf.row.problem is not None:
                steps[c] = float(run.state[c]) + 1  # (torch's step number at this step)
            values = {k: env.number(b(env)) for k, b in leaf.match.numbers.items()}
            for number, (test, reason) in leaf.match.checks.items():
                if not test(values[number]):
                    return f"leaf {name(leaves[0])!r}: {reason}"
            dtype = run.params[leaves[0]].dtype
            problem = (None if leaf.row.problem is None
                       else leaf.row.problem(values, dtype, steps[c if c in steps else None]))
            if problem is not None:
                return f"leaf {name(leaves[0])!r}: {problem}"
            kwargs = {k: v for k, v in values.items() if not k.startswith("_")}
            calls.append(([matched.leaves[i] for i in leaves], leaves,
                          {**leaf.row.flags, **leaf.match.flags, **kwargs}))
        entries = [(run.params[leaves[0]].dtype, leaves,
                    [k for i in leaves for kind, k in matched.leaves[i].match.lists
                     if kind == "entry" and k is not None]) for _, leaves, _ in calls]
        # (the per-leaf entries; the shared ones are written at each step, checked at each)
        return checked_launch(table, key, run, groups, entries, checked,
                              reread=not matched.row.bounded,
                              launch=lambda: _launch(run, calls, matched.counts))


def _launch(run: Leaves, calls: list[tuple[list[_Leaf], list[int], dict[str, Any]]],
            counts: tuple[int, ...]) -> None:
    """The foreach calls of a segment (per call: its leaves' matches, the leaves, the
    function's keyword arguments): the new params into ``run.params`` (their updates
    consumed: None), the new state entries into ``run.state``, each count advanced once
    (torch's step tensors are scratch)."""

    def owned(x: torch.Tensor) -> torch.Tensor:
        return x if run.donate else x.clone()

    written: dict[int, Any] = {c: _common.safe_increment(run.state[c]) for c in counts}
    for plans, leaves, kwargs in calls:
        n, first = len(leaves), plans[0]
        params = [owned(run.params[i]) for i in leaves]
        lists: list[Any] = []
        for j, (kind, k) in enumerate(first.match.lists):
            if kind == "entry":
                lists.append([owned(run.state[_entry(plan, j)]) for plan in plans])
            elif kind == "copy":
                assert k is not None
                x = run.state[k].to(params[0].device)
                lists.append(list(x.reshape(1).repeat(n).unbind(0)))
            elif kind == "steps":
                count = (torch.zeros((), dtype=torch.float64) if k is None
                         else run.state[k].to("cpu", torch.float64))
                lists.append(list(count.reshape(1).repeat(n).unbind(0)))
            else:  # ("empty": a list it takes empty; "none": an argument it takes as None)
                lists.append([] if kind == "empty" else None)
        first.row.function()(params, [run.updates[i] for i in leaves], *lists, **kwargs)
        for j, i in enumerate(leaves):
            run.params[i], run.updates[i] = params[j], None
        for j, (kind, k) in enumerate(first.match.lists):
            if kind == "entry":
                for x, plan in zip(lists[j], plans, strict=True):
                    run.state[_entry(plan, j)] = x
            elif kind == "copy":
                assert k is not None
                written[k] = lists[j][0].to(run.state[k].device).clone()
    for k, value in written.items():
        run.state[k] = value


def _entry(plan: _Leaf, j: int) -> int:
    """The flat state index of a leaf's ``j``-th list (an ``"entry"``)."""
    found = plan.match.lists[j][1]
    assert found is not None
    return found


FOREACH: Backend = _Foreach()
