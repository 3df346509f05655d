r"""The step planner: lowers a composed transform to fused kernels, per group of leaves.

Speed belongs to the transform as the user composed it. The planner reads the transform's
spec (``functopt/_spec.py``) together with its state, and writes down, for every leaf, the
*program* the pure path runs on it: the elementwise rules in order (``scale_by_adam``,
``add_decayed_weights``, the learning rate, ...) with the state entries each reads and
writes, and the global-norm clips that scale it. ``chain``, ``named_chain``, ``masked``,
``partition`` and ``inject_hyperparams`` only decide which leaves a rule sees and where its
state lives, so they disappear in the programs: ``adamw(mask=no_bias)`` gives the weights
the program "Adam, decay, lr" and the biases "Adam, lr".

Programs are then matched against the patterns PyTorch has a fused multi-tensor kernel
for, and the leaves are grouped by (device, dtype, kernel, hyperparameters, clip):

=============================================  ===========================================
program (after an optional leading clip)       kernel
=============================================  ===========================================
``scale_by_adam``, [``add_decayed_weights``],  ``torch._fused_adamw_`` (weight decay 0 where
learning rate                                  the decay is masked off)
[``add_decayed_weights``], [``trace`` or       ``torch._fused_sgd_`` (the decay before the
``dampened_trace``], learning rate             momentum: torch.optim.SGD's weight_decay;
                                               dampening and is_first_step for the latter)
``set_to_zero``                                nothing to do (a frozen group)
=============================================  ===========================================

A leading ``clip_by_global_norm`` (over all leaves or a masked subset) and the unscaling of
a mixed-precision step are folded into the kernel's ``grad_scale``; a skipped step into
its ``found_inf``. The norms every clip needs come from one local ``foreach`` pass and, on
sharded params, one all-reduce of a packed vector: one collective per step whatever the
chain (a rule with tree sums of its own, Prodigy's, has them in the same all-reduce,
unless a clip's factor must be known before its sums are taken: then in a second, see
``_tree_totals``). Anything else (a rule without a kernel, a clip after the moments, an opaque
transform) keeps the pure path for the whole step, and the reason is reported by
[`explain`][functopt.fast.explain] and by a one-time
[`FastPathWarning`][functopt.fast.FastPathWarning].

What the planner checks at every step, since the kernels read memory linearly: each
leaf's value, gradient and moments share dtype, shape and strides and are dense (a
gradient laid out differently is copied into its param's layout first); a leaf that
overlaps itself (an expanded tensor) or two leaves sharing storage (tied weights) cannot be
written in place and raise when donated, as do per-leaf state entries (which a donated fast
step writes in place) sharing memory with each other or with a param.

The structural part of a plan (the walk, the masks and labels, the injected factory's
spec) depends only on the transform and the tree structures, and is cached by the step
function per (params structure, state structure): a mask or label *function* is called
once per structure, not at every step as on the pure path.

This module holds `Planner`, which caches those structures and the lowered steps, and the
checks of donated leaves. The walk is in ``_walk.py`` (the parts of its programs in
``_programs.py``), the matching of programs to kernels and the kernel calls in
``_kernels.py``, a planned step's run in ``_planned.py``.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from functopt._base import GradientTransformation
from functopt._collective.dtensor import _leaf_names, local_tensor
from functopt.fast._kernels import _PLAIN, Group
from functopt.fast._layout import overlapping
from functopt.fast._planned import Lowered, lower
from functopt.fast._programs import Structure
from functopt.fast._walk import walk
from functopt.tree import _core

__all__ = ["Planner", "check_donation", "check_state_donation", "overlap"]


class Planner:
    """The structures of one transform, cached per (params structure and shapes, state
    structure): what a step function keeps between calls. It holds no tensor and nothing
    that changes a result (a plan is a function of the structures), so step functions can
    be shared between threads and states."""

    _SIZE = 8

    def __init__(self, tx: GradientTransformation) -> None:
        self.tx = tx
        self._cache: dict[Any, Structure] = {}
        # Lowered steps by the identity of the tensors they were checked on (weakly held):
        # a donated step sees the same params and state tensors every time, whose layouts
        # do not change, so the per-leaf layout and aliasing checks run once.
        self._lowered: dict[Any, tuple[list[Any], Lowered]] = {}
        self.reads: dict[int, Any] = {}  # host reads of unchanged hyperparameter tensors

    def lower(self, structure: Structure, state_spec: _core.TreeSpec, values: list[Any],
              grads: list[Any], state_leaves: list[Any], name: Callable[[int], str], *,
              donated: list[Any] | None = None, compiled: bool = False,
              compiled_first: bool = False) -> Lowered:
        """`lower`, remembered for the same tensors; ``donated``: leaves written in place,
        checked with `check_donation` the first time."""
        # (counters move at every step; the per-leaf entries are what is checked)
        slots = [state_leaves[k] for k in structure.slot_indices]
        # (the data pointers catch a param or a moment whose .data was replaced in place,
        # as module.to() or .half() do: same object, new memory, maybe a new dtype; the
        # dtypes and strides one whose .data became another view of its memory, a
        # square weight's transpose, say)
        key = (id(structure), compiled, compiled_first, tuple(map(id, values)),
               tuple([g is None for g in grads]),
               tuple(map(id, slots)), donated is not None,
               tuple([None if v is None else _address(v) for v in values]),
               tuple([_address(x) if isinstance(x, torch.Tensor) else None for x in slots]))
        hit = self._lowered.get(key)
        if hit is not None and all(
                (r() if isinstance(r, weakref.ref) else r) is x
                for r, x in zip(hit[0], itertools.chain(values, slots), strict=True)):
            return hit[1]
        spans = None if donated is None else check_donation(donated, name)
        lowered = lower(structure, state_spec, values, grads, state_leaves, name,
                        compiled=compiled, compiled_first=compiled_first)
        if donated is not None and lowered.fast:
            check_state_donation(values, name, structure.slot_indices, state_leaves,
                                 state_spec, spans if donated is values else None)
        refs = [weakref.ref(x) if isinstance(x, torch.Tensor) else x
                for x in itertools.chain(values, slots)]
        if len(self._lowered) >= self._SIZE:
            self._lowered.pop(next(iter(self._lowered)))
        self._lowered[key] = (refs, lowered)
        return lowered

    def compiled_groups(self, treespec: _core.TreeSpec, param_leaves: list[Any],
                        state_leaves: list[Any], state_spec: _core.TreeSpec,
                        compiled_first: bool = False) -> list[Group] | None:
        """The groups of a step with the compiled tier on these params (values standing in
        for their gradients) and state, or None when it would not be fast: what
        ``init`` and ``lay_out`` lay out before the first step (``compiled_first``: the
        mixed step's, see `_kernels.match`)."""
        params = _core.unflatten(treespec, param_leaves)
        structure = self.structure(params, treespec, param_leaves, state_leaves, state_spec)
        lowered = lower(structure, state_spec, param_leaves, param_leaves, state_leaves,
                        _leaf_names(treespec), compiled=True, compiled_first=compiled_first)
        return lowered.groups if lowered.fast else None

    def structure(self, params: Any, treespec: _core.TreeSpec, param_leaves: list[Any],
                  state_leaves: list[Any], state_spec: _core.TreeSpec,
                  mode: str | None = None) -> Structure:
        key = (treespec, state_spec,
               tuple([None if p is None else tuple(p.shape) for p in param_leaves]), mode)
        found = self._cache.get(key)
        if found is None:
            found = walk(self.tx, params, treespec, param_leaves, state_leaves, state_spec,
                         mode)
            if len(self._cache) >= self._SIZE:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = found
        return found


def _address(x: torch.Tensor) -> tuple[Any, ...]:
    """Where a tensor's elements are and how they are read (of its local shard)."""
    local = x if type(x) in _PLAIN else local_tensor(x)
    return (local.data_ptr(), local.dtype, local.stride(), local.shape)


def check_donation(values: list[Any], name: Callable[[int], str]) -> list[tuple[int, int, int]]:
    """Donated leaves are written in place: each must own its memory (views of one buffer
    are fine as long as they do not overlap). Returns the spans it checked, sorted (see
    `check_state_donation`)."""
    spans = _spans(values, name, "param")
    pair = _first_overlap(spans)
    if pair is not None:
        raise ValueError(
            f"{name(pair[0])!r} and {name(pair[1])!r}: the params share memory (tied weights, "
            f"or overlapping views of one tensor), so a donated step would update that "
            f"memory once per leaf. Fix: pass each shared tensor once (drop the tied copy "
            f"from the params tree), or step without donate.")
    return spans


def check_state_donation(values: list[Any], name: Callable[[int], str], slots: list[int],
                         state_leaves: list[Any], state_spec: _core.TreeSpec,
                         spans: list[tuple[int, int, int]] | None = None) -> None:
    """The per-leaf state entries (``slots``, flat indices) that a donated fast step writes in
    place must own their memory, apart from each other and from the values it writes (the
    params, a mixed step's masters, named by ``name``): where
    two share it (a transform's ``init`` that gave one tensor to two fields, a state loaded
    with such ties), writing one overwrites the other, which the pure step reads as it was.
    ``spans``: those `check_donation` returned for ``values`` (then not read again)."""
    entries = [state_leaves[k] for k in slots]
    given = len(values)

    def named(i: int) -> str:  # (paths only for a message: a state has many leaves)
        if i < given:
            return f"param {name(i)!r}"
        return f"state entry {_core.paths(state_spec)[slots[i - given]] or 'state'!r}"

    if spans is None:
        spans = _spans(values, named, "tensor")
    pair = _first_overlap([*spans, *_spans(
        [x if isinstance(x, torch.Tensor) else None for x in entries], named, "tensor",
        given)])
    if pair is not None:
        raise ValueError(
            f"{named(pair[0])} and {named(pair[1])} share memory, so a donated step "
            f"would write one over the other (the pure step reads each as it was). Fix: give "
            f"each state entry its own tensor (functopt.tree.map(torch.clone, state) copies "
            f"a state; a transform's init must not put one tensor in two fields), or step "
            f"without donate.")


def overlap(values: list[Any], name: Callable[[int], str], what: str,
            ) -> tuple[int, int] | None:
    """The first two leaves (indices) of ``values`` whose memory overlaps, or None; raises
    for a leaf that overlaps itself (an expanded tensor), a ``what`` named by ``name``."""
    return _first_overlap(_spans(values, name, what))


def _spans(values: list[Any], name: Callable[[int], str], what: str, start: int = 0,
           ) -> list[tuple[int, int, int]]:
    """(first byte, end byte, ``start`` + index) of each leaf of ``values`` with elements;
    raises for a leaf that overlaps itself (see `overlap`)."""
    spans: list[tuple[int, int, int]] = []
    for i, v in enumerate(values, start):
        if v is None:
            continue
        local = v if type(v) in _PLAIN else local_tensor(v)
        if local.is_contiguous():  # (nearly every leaf: its bytes from its address on)
            if local.nbytes:
                first = local.data_ptr()
                spans.append((first, first + local.nbytes, i))
            continue
        if local.numel() == 0:
            continue
        if overlapping(local):
            raise ValueError(
                f"{name(i)!r}: the {what} has strides {local.stride()} for shape "
                f"{tuple(local.shape)}, so several of its elements share memory (an "
                f"expanded tensor), and a donated step would write them several times. "
                f"Fix: optimize a tensor that owns its memory (x.clone() or "
                f"x.contiguous()), as torch.optim requires.")
        extent = 1 + sum((n - 1) * st for n, st in zip(local.shape, local.stride(),
                                                       strict=True))
        first = local.data_ptr()  # distinct allocations never share addresses
        spans.append((first, first + int(extent) * local.element_size(), i))
    return spans


def _first_overlap(spans: list[tuple[int, int, int]]) -> tuple[int, int] | None:
    """The first two leaves of ``spans`` (sorted here, in place) whose bytes overlap."""
    spans.sort()
    for a, b in itertools.pairwise(spans):
        if b[0] < a[1]:
            return a[2], b[2]
    return None
