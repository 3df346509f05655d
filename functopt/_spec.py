r"""What a transform computes, as data: the description the step planner reads.

A [`GradientTransformation`][functopt.GradientTransformation] is a pair of closures, which
nothing can look inside. The fast paths need to know what a composed transform computes
(``chain(clip_by_global_norm(1.0), adamw(...))`` is "clip, then Adam, then decoupled
decay, then the learning rate") to lower it to fused kernels. So every built-in transform
also carries a *spec*: a small tree of the nodes below, built by its factory from the same
arguments its closures use. The planner (``functopt/fast/_walk.py``) walks the spec
together with the state, and the closures stay the reference: a spec only says which pure
computation a fast path must reproduce, and the conformance law holds every lowering equal
to the closures.

A user's rule gets its spec from the public ``functopt.elementwise_rule`` or
``functopt.per_leaf_rule`` (``functopt/_rules.py``). A transform without a spec (one written
by hand without them, or wrapped) is *opaque*: it runs on the pure path, and the fast entry
points say so (``functopt.fast.explain``, a one-time warning).

The nodes:

- [`Leafwise`][functopt._spec.Leafwise]: a per-leaf elementwise rule, named by the factory
  that made it (``"scale_by_adam"``, ``"trace"``, ...), with its hyperparameters;
- [`PerLeaf`][functopt._spec.PerLeaf]: a per-leaf rule that is not elementwise (it reduces
  within a leaf or depends on its shape: Muon's Newton-Schulz iteration, a trust ratio),
  with the state fields it keeps per leaf and, optionally, an update that processes a
  group of leaves together (same-shape matrices batched);
- [`GlobalNormClip`][functopt._spec.GlobalNormClip]: ``clip_by_global_norm``, the one global
  reduction of a chain;
- [`Sequence`][functopt._spec.Sequence]: ``chain`` / ``named_chain``;
- [`Select`][functopt._spec.Select]: ``masked`` and ``partition``, which hand each inner
  transform a subset of the leaves;
- [`Injected`][functopt._spec.Injected]: ``inject_hyperparams``, whose inner transform is
  rebuilt from hyperparameters that live in the state;
- [`FiniteGuard`][functopt._spec.FiniteGuard]: ``apply_if_finite``, a skip decided by a
  finiteness check;
- [`ZeroNans`][functopt._spec.ZeroNans]: ``zero_nans``, nan entries made 0 and a per-leaf
  flag of whether there was one (reduced over the mesh for DTensor leaves).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from functopt._protocol import GradientTransformation

__all__ = [
    "FiniteGuard",
    "GlobalNormClip",
    "Injected",
    "Leafwise",
    "PerLeaf",
    "Select",
    "Sequence",
    "Spec",
    "SpecifiedTransformation",
    "ZeroNans",
    "describe",
    "specified",
]


class Spec:
    """A node of a transform's description (see the module docstring)."""


@dataclass(frozen=True, eq=False)
class Leafwise(Spec):
    """A per-leaf elementwise rule: ``kind`` names the factory, ``hyper`` its arguments.

    The rest is what the fast tiers know of the rule, each fact stated here once, by the
    factory that makes it:

    - ``slots``: the fields of its state that hold one tensor per leaf (derived from its
      ``<Name>State`` by [`state_slots`][functopt._rules.state_slots]); the others, a count
      or constants, are shared by the leaves. ``None``: its state layout is not known, and
      only its own update on the pure path can compute it.
    - ``sums`` / ``finish``: its reductions across leaves, if it has any (below).
    - ``kernel``: the part of PyTorch's fused kernels its arithmetic is, for functopt's own
      rules whose maths is the kernels' exactly: ``"adam"`` (Adam's moments),
      ``"amsgrad"``, ``"momentum"`` (SGD's), ``"dampened_momentum"``, ``"weight_decay"``,
      ``"learning_rate"``, ``"scale"``, ``"schedule"``, ``"identity"``, ``"zero"``.
      ``None``: no kernel; an elementwise rule with known ``slots`` takes the compiled tier.
    """

    kind: str
    hyper: Mapping[str, Any] = field(default_factory=dict)
    # the update function of the transform this spec describes, set by ``specified``: the
    # planner's compiled tier runs it on a group's leaves laid end to end
    update: Callable[..., Any] | None = field(default=None, compare=False, repr=False)
    # a rule whose update also sums over all its leaves (Prodigy, D-Adaptation): its update
    # as two halves, ``sums(updates, state, params)`` (a tuple of 0-d tensors, this
    # process's sums over the leaves given) and ``finish(updates, state, params, totals)``
    # (the update, given those sums over every leaf and rank), so the compiled tier can
    # add the groups' and ranks' sums in between
    sums: Callable[..., Any] | None = field(default=None, compare=False, repr=False)
    finish: Callable[..., Any] | None = field(default=None, compare=False, repr=False)
    slots: tuple[str, ...] | None = None
    kernel: str | None = None

    @property
    def elementwise(self) -> bool:
        """Whether each element of its update comes from the same element of its inputs
        (so its update over leaves laid end to end is its update leaf by leaf)."""
        return True

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.hyper.items())
        return f"{self.kind}({args})"


@dataclass(frozen=True, eq=False, repr=False)
class PerLeaf(Leafwise):
    """A per-leaf rule that is not elementwise: each leaf's update depends on the whole leaf
    (a matrix function, a norm of the leaf, its shape), never on another leaf's values.

    Its shared state fields (those not in ``slots``) may change, besides the count, only on
    a step where some leaf has a gradient. ``grouped``, if given, has the contract of
    ``update`` (same trees, same results up to rounding) and may process the leaves with a
    gradient together: the planner's per-leaf tier calls it on the leaves of one group
    (``None`` at the others), where the pure path calls ``update``.
    """

    grouped: Callable[..., Any] | None = field(default=None, compare=False)

    @property
    def elementwise(self) -> bool:
        return False


@dataclass(frozen=True, eq=False)
class GlobalNormClip(Spec):
    """``clip_by_global_norm(max_norm)``: scale every update by ``min(1, max_norm / norm)``.

    ``sums`` and ``finish``: its update as two halves, with the contract of
    `Leafwise.sums` / `Leafwise.finish` (the compiled tier's lowering of a clip that comes
    after other rules, whose norm is of their updates)."""

    max_norm: Any
    sums: Callable[..., Any] | None = field(default=None, compare=False, repr=False)
    finish: Callable[..., Any] | None = field(default=None, compare=False, repr=False)

    def __repr__(self) -> str:
        return f"clip_by_global_norm({self.max_norm!r})"


@dataclass(frozen=True, eq=False)
class FiniteGuard(Spec):
    """``apply_if_finite(inner, max_consecutive_errors)``: skip ``inner``'s step (zero
    updates, its state kept) when the updates entering it are not all finite, unless more
    than ``max_consecutive_errors`` steps in a row were."""

    inner: Spec | None
    max_consecutive_errors: int
    # its update as two halves, with the contract of `Leafwise.sums` / `Leafwise.finish`:
    # this process's count of the non-finite entries it is given (float64), and the update
    # given that count over every leaf and rank (the compiled tier's lowering of a guard
    # after other rules, whose check is of their updates)
    sums: Callable[..., Any] | None = field(default=None, compare=False, repr=False)
    finish: Callable[..., Any] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, eq=False)
class ZeroNans(Spec):
    """``zero_nans()``: every nan of the updates becomes 0, and ``state.found_nan`` records
    per leaf whether the leaf's update held one (for a DTensor leaf, anywhere on the mesh).
    ``zeroed(update) -> (zeroed update, this process's flag)`` is its update of one leaf:
    the fast paths call it (and reduce the DTensor leaves' flags in the step's one packed
    all-reduce)."""

    zeroed: Callable[[Any], tuple[Any, Any]] = field(compare=False, repr=False)

    def __repr__(self) -> str:
        return "zero_nans()"


@dataclass(frozen=True, eq=False)
class Sequence(Spec):
    """``chain`` (``names`` None: the state is a tuple) or ``named_chain`` (a dict)."""

    children: tuple[Spec | None, ...]
    names: tuple[str, ...] | None = None

    def states(self, state: Any) -> list[tuple[Spec | None, Any, str]] | None:
        """Each child with its part of ``state`` and its label (its position or name), or
        None when ``state`` does not hold one entry per child."""
        if self.names is None:
            parts, labels = list(state), [str(i) for i in range(len(state))]
        else:
            parts, labels = [state[name] for name in self.names], list(self.names)
        if len(parts) != len(self.children):
            return None
        return list(zip(self.children, parts, labels, strict=True))


@dataclass(frozen=True, eq=False)
class Select(Spec):
    """``masked`` or ``partition``: each child sees the leaves ``select`` gives it (and
    ``contrib.schedule_free``: its base optimizer, then its averaging, both on every leaf,
    in the children's order).

    ``select(params_tree, treespec, leaves)`` returns, per key of ``children``, the indices
    of the leaves that child transforms (the same function the transform's ``update``
    uses). ``state_of(state, key)`` is that child's state within this node's state.
    """

    children: Mapping[Hashable, Spec | None]
    select: Callable[[Any, Any, list[Any]], Mapping[Hashable, list[int]]]
    state_of: Callable[[Any, Hashable], Any]
    name: str = "masked"


@dataclass(frozen=True, eq=False)
class Injected(Spec):
    """``inject_hyperparams(factory)(...)``.

    ``build(hyperparams)`` makes the inner transform from a dict of 0-d tensors (the
    planner passes placeholders and finds them again in the inner spec, so it knows which
    state entry each inner hyperparameter reads); ``names`` are the injected keys;
    ``schedules`` maps the scheduled ones to their schedule of the count.
    """

    build: Callable[[dict[str, Any]], GradientTransformation]
    names: tuple[str, ...]
    schedules: Mapping[str, Callable[[Any], Any]]
    values_at: Callable[[Any, dict[str, Any]], dict[str, Any]]
    # the hyperparameters ``init`` puts in its state when its count is on ``device`` (None:
    # only ``init`` itself says)
    initial: Callable[[Any], dict[str, Any]] | None = None


class SpecifiedTransformation(GradientTransformation):
    """A [`GradientTransformation`][functopt.GradientTransformation] that also says what it
    computes (its ``spec``). Still the pair ``init, update``; used exactly like any
    transform. A new NamedTuple made from one (``tx._replace(...)``) is opaque again."""

    spec: Spec | None = None

    def __new__(cls, init: Any, update: Any, spec: Spec | None = None,
                ) -> SpecifiedTransformation:
        self = super().__new__(cls, init, update)
        self.spec = spec
        return self

    def __repr__(self) -> str:
        return f"GradientTransformation(spec={self.spec!r})"

    def __reduce__(self) -> Any:
        return (SpecifiedTransformation, (self.init, self.update, self.spec))


def specified(tx: GradientTransformation, spec: Spec | None) -> GradientTransformation:
    """``tx`` carrying ``spec`` (a factory's last line: ``return specified(tx, Leafwise(...))``).
    A [`Leafwise`][functopt._spec.Leafwise] spec also keeps ``tx.update``, the reference the
    compiled tier runs."""
    if isinstance(spec, Leafwise) and spec.update is None:
        object.__setattr__(spec, "update", tx.update)
    return SpecifiedTransformation(tx.init, tx.update, spec)


def describe(tx: Any) -> Spec | None:
    """The spec of ``tx``, or None for an opaque transform."""
    spec = getattr(tx, "spec", None)
    return spec if isinstance(spec, Spec) else None
