"""What a donated fused mixed step remembers of its inputs, to skip its checks next time.

A training loop hands the same params, masters and moments to the step at every call (a
donated step updates them in place), with new gradients of the same dtypes and shapes. The
step's checks (structures, dtypes, shapes, devices, the masters against the params) and
the planner's lowering read nothing else, so a step whose inputs `Seen.match` the ones
a previous step checked and lowered skips them. Anything else (another tensor in a
param's, a master's or a moment's place, one whose ``.data`` was replaced, a gradient of
another dtype, shape or device, another structure) runs every check and the lowering
again, so errors, refusals and warnings are those of a first step. The same rule as
``make_step``'s (``functopt/fast/_step.py``: ``_Seen``), for the mixed step's inputs.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from functopt.fast import _planned, _programs
from functopt.fast._step import _PLAIN, _meta
from functopt.tree import _core

__all__: list[str] = []

# (structure, the inner state's leaves at that step, the lowering): `_fused._lowered`'s
Lowering = tuple[_programs.Structure, list[Any], _planned.Lowered]


_TENSOR_OR_NONE = (torch.Tensor, type(None))


def _tensor_leaves(leaves: list[Any]) -> bool:
    return all(isinstance(x, _TENSOR_OR_NONE) for x in leaves)


@dataclass(eq=False)
class Seen:
    """The inputs of a fused mixed step whose checks passed and which the planner lowered:
    params and masters (weakly held) with their metadata, per leaf the gradient dtypes
    allowed (None: the gradient was None), the inner state's per-leaf entries (weakly held,
    with their addresses), and what the step derived from them. Holds no tensor."""

    KEPT = 4  # records kept per step function and thread (one per params structure)

    treespec: _core.TreeSpec
    params: list[Any]  # weakref or None, per leaf
    meta: list[Any]  # _meta or None, per leaf
    stores: list[Any]  # weakref or None (a param without master), per leaf
    store_meta: list[Any]
    grads: list[tuple[torch.dtype, torch.dtype] | None]
    slot_refs: list[Any]
    slot_ptrs: list[int]
    lowering: Lowering
    name: Any  # _leaf_names(treespec)
    counted: list[bool]
    # what the step grouped of its casts and writes, reused while they fit (_fused.py:
    # `_recalled_casts`, `_recalled_writes`)
    casts: dict[str, Any] = field(default_factory=dict)
    # per leaf (params, meta, stores, store_meta, grads): one list to walk per step
    rows: list[tuple[Any, ...]] = field(init=False)

    def __post_init__(self) -> None:
        self.rows = list(zip(self.params, self.meta, self.stores, self.store_meta,
                             self.grads, strict=True))

    @classmethod
    def of(cls, param_leaves: list[Any], treespec: _core.TreeSpec, grad_leaves: list[Any],
           stores: list[Any], views: list[Any], lowering: Lowering, name: Any,
           counted: list[bool]) -> Seen | None:
        """The record of a step that passed its checks, or None when its inputs are not
        plain tensors whose metadata tells everything (a DTensor's does not)."""
        structure, inner_leaves, _ = lowering
        entries = [inner_leaves[k] for k in structure.slot_indices]
        if any(x is not None and type(x) not in _PLAIN
               for x in (*param_leaves, *stores, *entries)) or not _tensor_leaves(inner_leaves):
            return None
        return cls(
            treespec, [None if p is None else weakref.ref(p) for p in param_leaves],
            [None if p is None else _meta(p) for p in param_leaves],
            [None if s is None else weakref.ref(s) for s in stores],
            [None if s is None else _meta(s) for s in stores],
            [None if g is None else (p.dtype, v.dtype)
             for g, p, v in zip(grad_leaves, param_leaves, views, strict=True)],
            [weakref.ref(e) for e in entries], [e.data_ptr() for e in entries],
            lowering, name, counted)

    def match(self, grads: Any, state: Any, params: Any,
              ) -> tuple[list[Any], list[Any], list[Any], list[Any]] | None:
        """``(param leaves, grad leaves, stores, inner state leaves)`` if these inputs are
        the ones seen, unchanged in everything the checks and the lowering read; else
        None."""
        treespec = self.treespec
        structure, _, lowered = self.lowering
        try:
            param_leaves = treespec.flatten_up_to(params)
            grad_leaves = treespec.flatten_up_to(grads)
            stores = treespec.flatten_up_to(state.master)
            inner_leaves = lowered.state_spec.flatten_up_to(state.inner_state)
        except (ValueError, TypeError):
            return None
        if not _tensor_leaves(inner_leaves):
            return None  # (a subtree where a tensor was: not the structure seen)
        for p, s, g, (ref, meta, store_ref, store_meta, allowed) in zip(
                param_leaves, stores, grad_leaves, self.rows, strict=True):
            if ref is None:
                if p is not None or s is not None or g is not None:
                    return None
                continue
            # (_meta, inlined: twelve calls a step on a small model)
            if p is None or p is not ref() or (
                    p.dtype, p.shape, p.stride(), p.device, p.data_ptr()) != meta:
                return None
            if store_ref is None:
                if s is not None:
                    return None
            elif s is None or s is not store_ref() or (
                    s.dtype, s.shape, s.stride(), s.device, s.data_ptr()) != store_meta:
                return None
            if g is None:
                if allowed is not None:
                    return None
                continue
            # _check_grads' checks, against the param's dtype, shape and device seen
            if allowed is None or type(g) not in _PLAIN or g.layout != torch.strided or (
                    g.dtype not in allowed or g.shape != meta[1] or g.device != meta[3]):
                return None
        for k, ref, ptr in zip(structure.slot_indices, self.slot_refs, self.slot_ptrs,
                               strict=True):
            entry = inner_leaves[k]
            if entry is None or entry is not ref() or entry.data_ptr() != ptr:
                return None
        return param_leaves, grad_leaves, stores, inner_leaves
