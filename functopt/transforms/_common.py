"""Helpers shared by the built-in transforms (private).

The built-ins flatten the updates once, line the state and params up against the updates'
treespec, and write their maths per leaf with ordinary (out-of-place) torch ops: that form
is pure, works on DTensor local shards, and works under ``torch.func.grad`` / ``vmap``
(PyTorch's ``_foreach_*`` ops do not, as of 2.13). Fast paths live elsewhere and are tested
equal to these.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from functopt import _validate
from functopt._base import Numeric
from functopt.tree import _core

INT32_MAX = 2**31 - 1

# The state checks live in _validate (layer 0), so that the protocol's identity uses them.
STATE_TYPE_MISMATCH = _validate.STATE_TYPE_MISMATCH
describe_state = _validate.describe_state
check_state = _validate.check_state


SCHEDULE_VALUE = (
    "{owner}: the schedule passed as {arg} ({name}) returned {got}; expected a Python "
    "number or a 0-d tensor: a schedule maps the step count (a 0-d int32 tensor) to one "
    "value of the hyperparameter for every leaf. Fix: return a float or a 0-d tensor, such "
    "as `lambda count: 0.1 * 0.99 ** count` or a functopt.schedules function; for values "
    "that differ between params, give each group its own schedule with "
    "functopt.partition(...)."
)


def _describe_value(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def schedule_value(owner: str, arg: str, schedule: Callable[[Any], Any], count: Any) -> Any:
    """``schedule(count)``, refused with ``TypeError`` (``SCHEDULE_VALUE``) unless it is a
    number or a 0-d non-boolean tensor (a shape-(3,) result would broadcast elementwise on
    one path and fail on another; a string would fail deep inside with no word of the
    schedule). No host read: only the type and shape are looked at."""
    value = schedule(count)
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool)) or (
        isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype != torch.bool
        and not value.is_complex())
    if not ok:
        name = getattr(schedule, "__qualname__", None) or type(schedule).__name__
        raise TypeError(SCHEDULE_VALUE.format(owner=owner, arg=arg, name=name,
                                              got=_describe_value(value)))
    return value


def check_params_structure(owner: str, treespec: _core.TreeSpec, params: Any) -> None:
    """Where ``params`` are given to a transform that does not read them, they must still
    have the updates' structure: a grads tree with an extra or a missing leaf is a bug
    (grads of another model, a renamed param) that a stateless recipe would otherwise pass
    through silently. One ``flatten_up_to`` (a tenth of a flatten)."""
    if params is None:
        return
    try:
        _core.flatten_like(treespec, params, name="params", reference="updates")
    except ValueError as error:
        raise ValueError(f"{owner}: {error}") from None


def flatten_updates(updates: Any) -> tuple[list[Any], _core.TreeSpec]:
    """Flatten the updates; every leaf must be a floating tensor or None."""
    leaves, treespec = _core.flatten(updates)
    _core.check_tensors(leaves, treespec, name="updates", floating=True)
    return leaves, treespec


def flatten_params(params: Any) -> tuple[list[Any], _core.TreeSpec]:
    """Flatten params for ``init``; every leaf must be a floating tensor or None."""
    leaves, treespec = _core.flatten(params)
    _core.check_tensors(leaves, treespec, name="params", floating=True)
    return leaves, treespec


def params_like(
    treespec: _core.TreeSpec, params: Any, updates: Sequence[Any], *, owner: str
) -> list[Any]:
    """The params' leaves lined up with the updates (for transforms that read params)."""
    if params is None:
        if all(u is None for u in updates):
            # Nothing to update (e.g. `masked` selected no leaf of a one-tensor tree, whose
            # masked params tree is then None itself): nothing needs the params either.
            return [None] * len(updates)
        raise ValueError(
            f"{owner} reads the params, but update() was called without them. "
            f"Fix: call update(updates, state, params)."
        )
    leaves = _core.flatten_like(treespec, params, name="params", reference="updates")
    _core.check_tensors(leaves, treespec, name="params", floating=True)
    _core.check_like(updates, leaves, treespec, name="update", reference_name="param")
    return leaves


STATE_DEVICE = (
    "{name} leaf {path!r} is on {got} but its update is on {want}: a state lives on its "
    "params' device (PyTorch would stop with an error that names no leaf). Fix: init the "
    "state on the params where they are now, or move it there, e.g. "
    "functopt.tree.map(lambda x: x.to({want_str!r}), state) (after an offload: "
    "functopt.distributed.reload(offloaded, {want_str!r}))."
)


def state_like(treespec: _core.TreeSpec, tree: Any, *, name: str,
               like: Sequence[Any]) -> list[Any]:
    """A per-leaf state field lined up with the updates ``like``, on their devices.

    Raises ``ValueError`` (``STATE_DEVICE``) naming the first leaf whose state tensor is
    on another device than its update (the check reads device attributes only)."""
    leaves = _core.flatten_like(treespec, tree, name=name, reference="updates")
    for i, (leaf, ref) in enumerate(zip(leaves, like, strict=True)):
        if (isinstance(leaf, torch.Tensor) and isinstance(ref, torch.Tensor)
                and leaf.device != ref.device):
            raise ValueError(STATE_DEVICE.format(
                name=name, path=_core.paths(treespec)[i], got=leaf.device, want=ref.device,
                want_str=str(ref.device)))
    return leaves


def first_device(leaves: Sequence[Any]) -> torch.device:
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    return torch.device("cpu")


def zero_count(leaves: Sequence[Any]) -> torch.Tensor:
    """A 0-d int32 step counter on the device of the first tensor leaf."""
    return torch.zeros((), dtype=torch.int32, device=first_device(leaves))


def safe_increment(count: torch.Tensor) -> torch.Tensor:
    """``count + 1``, saturating at the int32 maximum instead of wrapping to negative.

    (Two kernels, ``count + (count < max)``: the step counters of a small model's fused
    step are a visible part of its time.)"""
    return count + (count < INT32_MAX)


def advance(count: torch.Tensor, skipped: torch.Tensor | None) -> torch.Tensor:
    """``safe_increment(count)``, or ``count`` itself where ``skipped`` (a 0-d flag, bool or
    float) is set: a step a fused kernel skipped on overflow leaves its counters as they
    were, as the pure path's restored state does."""
    new = safe_increment(count)
    if skipped is None:
        return new
    return torch.where(skipped.to(count.device) != 0, count, new)


def bias_correction(decay: Any, count: torch.Tensor) -> torch.Tensor:
    """``1 - decay ** count`` as a 0-d float64 tensor.

    Float64 keeps the factor exact enough to match torch.optim (which uses Python floats) in
    float64 runs; pass it through ``scalar`` before it meets a leaf.
    """
    factor: torch.Tensor = 1 - decay ** count.to(torch.float64)
    return factor


def scalar(value: Any, dtype: torch.dtype) -> Any:
    """``value``, a scalar about to meet a leaf whose maths runs in ``dtype``, cast to it.

    Every scalar a transform derives from its count, a schedule, a hyperparameter (injected
    ones are 0-d float64 tensors) or a norm goes through here first. Torch lets a 0-d tensor
    promote another 0-d tensor, never a tensor with dimensions: an uncast float64 scalar would
    run a 0-d float32 / bfloat16 / float16 leaf's maths in float64 while a shape-(1,) leaf of
    the same value runs in its own dtype, and the two would round differently. Cast first, a
    0-d leaf is computed exactly like a one-element leaf (tests/test_zero_dim.py).

    ``dtype`` is the dtype the operation runs in: the widened dtype of moment maths
    (``compute_dtype``), or the leaf's own dtype for a comparison done in it; products kept in
    a leaf's dtype go through ``scaled``. A float64 leaf keeps its float64 scalars. Casting a
    0-d tensor is differentiable and reads nothing back to the host (fine under
    ``torch.func``); a Python number is returned as it is, as it never promotes a tensor.
    """
    if isinstance(value, torch.Tensor):
        return value.to(dtype)
    return value


def scaled(x: torch.Tensor, factor: Any) -> torch.Tensor:
    """``factor * x`` in ``x``'s dtype: formed in ``compute_dtype(x.dtype)``, rounded once.

    This is what torch does for a Python-number factor (a half-precision tensor is scaled in
    float32). For a tensor factor torch rounds the factor to the half-precision dtype first
    or not, depending on the operand order and on ``x`` having dimensions; here a tensor
    factor, a number, a 0-d and a one-element ``x`` all give the same bits.
    """
    dtype = compute_dtype(x.dtype)
    out: torch.Tensor = (scalar(factor, dtype) * x.to(dtype)).to(x.dtype)
    return out


def zeros_like(leaf: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.zeros_like(leaf, dtype=dtype or leaf.dtype)


def unflatten(treespec: _core.TreeSpec, leaves: Sequence[Any]) -> Any:
    return _core.unflatten(treespec, leaves)


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype moment maths runs in: the widest of ``dtypes`` and float32."""
    out = torch.float32
    for dtype in dtypes:
        out = torch.promote_types(out, dtype)
    return out


def check_state_present(
    owner: str, treespec: _core.TreeSpec, grads: list[Any], *, same_shape: bool = True,
    **fields: list[Any],
) -> None:
    """Raise naming the first leaf whose state cannot go with its gradient.

    A state leaf is None where the param was None at ``init`` but now gets a gradient; with
    ``same_shape`` a state leaf must also have the gradient's shape (torch would otherwise
    broadcast a stale state silently).
    """
    for name, leaves in fields.items():
        for i, (g, s) in enumerate(zip(grads, leaves, strict=True)):
            if g is None:
                continue
            if s is None:
                raise ValueError(
                    f"{owner}: {_core.paths(treespec)[i]!r} has a gradient but state.{name} "
                    f"holds None there (its param was None when init ran). Fix: call init on "
                    f"params that hold a tensor at every leaf you will update."
                )
            if same_shape and s.shape != g.shape:
                raise ValueError(
                    f"{owner}: {_core.paths(treespec)[i]!r}: state.{name} has shape "
                    f"{tuple(s.shape)} but the gradient has shape {tuple(g.shape)}. Fix: build "
                    f"the state with init(params) on the params these gradients belong to."
                )


def check_betas(owner: str, *, closed: bool = False, **betas: Any) -> None:
    hint = "Fix: decay rates are in [0, 1]." if closed else (
        "Fix: decay rates are in [0, 1) (the bias correction divides by 1 - decay**t); "
        "0.9 and 0.999 are usual."
    )
    for name, value in betas.items():
        _validate.check_range(owner, name, value, low=0.0, high=1.0, high_open=not closed,
                              hint=hint)


def full(leaves: list[Any], value: Numeric) -> list[Any]:
    """Per-leaf tensors of the param's dtype filled with ``value`` (None where the param is).

    ``zeros + value`` rather than ``full_like`` so that a 0-d tensor ``value`` works without
    reading it back to the host.
    """
    return [None if p is None else torch.zeros_like(p) + scalar(value, p.dtype) for p in leaves]


def map_with_state(
    fn: Callable[..., tuple[Any, ...]], grads: Sequence[Any], *states: Sequence[Any]
) -> tuple[list[Any], ...]:
    """Leaf by leaf, ``fn(g, *state_leaves) -> (update, *new_state_leaves)``.

    Where a gradient is ``None`` (a param without gradient) the update is ``None`` and
    every state leaf passes through unchanged; ``fn`` is not called. Returns one list per
    output: the updates first, then each new state field.
    """
    outputs: list[list[Any]] = [[] for _ in range(1 + len(states))]
    for g, *leaf_states in zip(grads, *states, strict=True):
        results = (None, *leaf_states) if g is None else fn(g, *leaf_states)
        for out, value in zip(outputs, results, strict=True):
            out.append(value)
    return tuple(outputs)


class OnDevice:
    """A 0-d condition, moved once to each device it is needed on."""

    def __init__(self, cond: torch.Tensor) -> None:
        self._by_device = {cond.device: cond}

    def on(self, device: torch.device) -> torch.Tensor:
        if device not in self._by_device:
            self._by_device[device] = next(iter(self._by_device.values())).to(device)
        return self._by_device[device]


def select_tree(keep_old: torch.Tensor, old: Any, new: Any, *, owner: str, name: str) -> Any:
    """Leaf by leaf, ``old`` where ``keep_old`` (a 0-d bool) is true and ``new`` elsewhere:
    the one skip selection of functopt (``apply_if_finite``'s inner state, the
    mixed-precision step's), bitwise the old leaf when kept, in the old leaf's dtype.
    A leaf that is the same object on both sides is kept as it is; a leaf that changes
    must be a tensor of fixed shape on both sides (``owner`` and ``name`` word the errors).
    """
    old_leaves, treespec = _core.flatten(old)
    new_leaves = _core.flatten_like(treespec, new, name=f"new {name}", reference=f"old {name}")
    cond = OnDevice(keep_old)
    out = []
    for i, (o, n) in enumerate(zip(old_leaves, new_leaves, strict=True)):
        if n is o:
            out.append(o)  # unchanged leaves (None, constants) need no select
            continue
        if not (isinstance(o, torch.Tensor) and isinstance(n, torch.Tensor)):
            raise TypeError(
                f"{owner}: {name} leaf {_core.paths(treespec)[i]!r} went from "
                f"{_core._describe(o)} to {_core._describe(n)}; expected a tensor on both "
                f"sides (or the same object, such as None). Fix: keep every value that changes "
                f"from step to step in a tensor, so that a skipped step can restore it without "
                f"reading it on the host."
            )
        if n.shape != o.shape:
            raise ValueError(
                f"{owner}: {name} leaf {_core.paths(treespec)[i]!r} changed shape from "
                f"{tuple(o.shape)} to {tuple(n.shape)}; a skipped step must restore the old "
                f"value. Fix: keep the shapes of a state fixed from step to step."
            )
        out.append(torch.where(cond.on(o.device), o, n.to(o.dtype)))
    return _core.unflatten(treespec, out)
