"""A donated fused mixed step remembers what it checked and lowered for the tensors it saw
(``functopt/precision/_seen.py``): what changes between two steps must be seen on the
second, never served from what the first checked.

Each case warms a donating ``mixed_precision`` step up, changes one thing, and steps again;
a step function that has seen nothing (``mixed_precision`` made anew) on copies of the same
changed inputs is the reference: the same values bitwise, or the same error, or the same
warning.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_step_cache import _outcome, _same  # (what a step returned, raised or warned)

import functopt
import functopt.testing
from functopt.precision import _fused

BF16, F64 = torch.bfloat16, torch.float64


def _step() -> functopt.precision.MixedPrecisionTransformation:
    return functopt.precision.mixed_precision(
        functopt.adamw(1e-2, weight_decay=0.1), loss_scale=functopt.dynamic_loss_scale(
            2.0**8, growth_interval=2), max_grad_norm=1.0, donate=True)


def _inputs() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 3, generator=g).to(BF16),
              "b": torch.randn(3, generator=g).to(BF16),
              "f": torch.randn(3, generator=g)}  # float32: its own master
    grads = {k: (torch.randn(p.shape, generator=g) * 2**8).to(p.dtype)
             for k, p in params.items()}
    return params, grads


def _warmed(steps: int = 2) -> tuple[Any, Any, Any, Any]:
    step = _step()
    params, grads = _inputs()
    state = step.init(params)
    with torch.no_grad():
        for _ in range(steps):
            params, state = step.step(grads, state, params)
    return step, params, grads, state


def _master(state: Any, **master: Any) -> Any:
    return state._replace(master={**state.master, **master})


def _adam(state: Any) -> Any:
    return state.inner_state[0]


def _with_adam(state: Any, adam: Any) -> Any:
    return state._replace(inner_state=(adam, *state.inner_state[1:]))


CHANGES: dict[str, Callable[[Any, Any, Any], tuple[Any, Any, Any]]] = {
    "unchanged": lambda p, g, s: (p, g, s),
    "grads new tensors": lambda p, g, s: (p, {k: v.clone() for k, v in g.items()}, s),
    "grad float32 (a main grad)": lambda p, g, s: (p, {**g, "w": g["w"].float()}, s),
    "grad overflows": lambda p, g, s: (p, {**g, "b": torch.full_like(g["b"], torch.inf)}, s),
    "grad float64": lambda p, g, s: (p, {**g, "w": g["w"].to(F64)}, s),
    "grad shape": lambda p, g, s: (p, {**g, "w": torch.zeros(3, 4, dtype=BF16)}, s),
    "grad int": lambda p, g, s: (p, {**g, "b": torch.zeros(3, dtype=torch.int64)}, s),
    "grad sparse": lambda p, g, s: (p, {**g, "f": g["f"].to_sparse()}, s),
    "grad None": lambda p, g, s: (p, {**g, "b": None}, s),
    "grad not a tensor": lambda p, g, s: (p, {**g, "b": [1.0, 2.0, 3.0]}, s),
    "grad structure": lambda p, g, s: (p, {"w": g["w"]}, s),
    "param swapped": lambda p, g, s: ({**p, "w": p["w"] * 2}, g, s),
    "param structure": lambda p, g, s: ({**p, "w": {"x": p["w"]}}, g, s),
    "master swapped": lambda p, g, s: (p, g, _master(s, w=s.master["w"] + 1.0)),
    "master None": lambda p, g, s: (p, g, _master(s, b=None)),
    "moment swapped": lambda p, g, s: (p, g, _with_adam(s, _adam(s)._replace(
        mu={**_adam(s).mu, "w": _adam(s).mu["w"] + 1.0}))),
    "inner state structure": lambda p, g, s: (p, g, s._replace(inner_state=_adam(s))),
}


def _param_dtype_in_place(p: Any, g: Any, s: Any) -> tuple[Any, Any, Any]:
    p["w"].data = p["w"].data.float()  # as module.float() does: the same object
    return p, {**g, "w": g["w"].float()}, s


def _param_shape_in_place(p: Any, g: Any, s: Any) -> tuple[Any, Any, Any]:
    p["w"].data = torch.zeros(2, 6, dtype=BF16)
    return p, {**g, "w": torch.zeros(2, 6, dtype=BF16)}, s


def _param_tied_in_place(p: Any, g: Any, s: Any) -> tuple[Any, Any, Any]:
    p["b"].data = p["w"].data[0]  # shares the weight's memory: a donated step refuses
    return p, g, s


def _master_dtype_in_place(p: Any, g: Any, s: Any) -> tuple[Any, Any, Any]:
    s.master["w"].data = s.master["w"].data.to(BF16)  # narrower than the master dtype
    return p, g, s


def _master_shape_in_place(p: Any, g: Any, s: Any) -> tuple[Any, Any, Any]:
    s.master["w"].data = torch.zeros(3, 4)
    return p, g, s


def _moment_data_in_place(p: Any, g: Any, s: Any) -> tuple[Any, Any, Any]:
    _adam(s).nu["b"].data = torch.zeros(3, dtype=F64)
    return p, g, s


def _moments_tied_in_place(p: Any, g: Any, s: Any) -> tuple[Any, Any, Any]:
    _adam(s).nu["w"].data = _adam(s).mu["w"].data  # two entries, one memory: refused
    return p, g, s


CHANGES.update({f.__name__.strip("_").replace("_", " "): f for f in (
    _param_dtype_in_place, _param_shape_in_place, _param_tied_in_place,
    _master_dtype_in_place, _master_shape_in_place, _moment_data_in_place,
    _moments_tied_in_place)})
# (copies would not share memory: stepped as they are)
_SHARED = {"param tied in place", "moments tied in place"}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_is_seen_on_the_next_step(change: str) -> None:
    step, params, grads, state = _warmed()
    params, grads, state = CHANGES[change](params, grads, state)
    clone = functopt.testing.clone_tree
    ref = (params, grads, state) if change in _SHARED else (
        clone(params), clone(grads), clone(state))
    fresh = _step()
    with torch.no_grad():
        expected = _outcome(lambda: fresh.step(ref[1], ref[2], ref[0]))
        got = _outcome(lambda: step.step(grads, state, params))
    _same(got, expected)


def test_the_next_step_skips_the_checks_and_the_lowering(monkeypatch) -> None:
    # (what the record is for: the planner is asked once for unchanged inputs)
    step, params, grads, state = _warmed(1)
    calls = []
    real = _fused._lowered
    monkeypatch.setattr("functopt.precision.step._lowered",
                        lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        params, state = step.step({k: g.clone() for k, g in grads.items()}, state, params)
        assert calls == []
        params = {**params, "w": params["w"].clone()}  # another tensor: lowered again
        step.step(grads, state, params)
    assert calls == [1]


# -- the casts and writes a recalled step groups once (_fused.py: `_recalled_casts`,
# `_recalled_writes`): each step of a sequence equals a step function that has seen nothing

def _resize_a_buffer(step: Any) -> None:
    step.buffers()[0].resize_(0)


def _buffer_dtype(step: Any) -> None:
    buffer = step.buffers()[0]
    buffer.data = buffer.data.to(F64)


def _buffers_taken(step: Any) -> None:
    # the same step function (and thread) casts other params' gradients into its buffers
    g = torch.Generator().manual_seed(1)
    other = {"x": torch.randn(3, 4, generator=g).to(BF16),
             "y": torch.randn(2, generator=g).to(BF16)}
    grads = {k: (torch.randn(p.shape, generator=g) * 2**8).to(BF16) for k, p in other.items()}
    with torch.no_grad():
        step.step(grads, step.init(other), other)


SEQUENCES: dict[str, list[Callable[[Any], None] | str | None]] = {
    # None: a step on the warm inputs; a str: that many float32 gradients
    "grad dtypes back and forth": ["w", None, "w,b", "b", None],
    "a buffer resized": [_resize_a_buffer, None],
    "grouped for float32 grads, then bfloat16": [_resize_a_buffer, "w,b", None],
    "a buffer's dtype replaced": [_buffer_dtype, None],
    "buffers taken by other params": [_buffers_taken, None, _buffers_taken, "w", None],
}


@pytest.mark.parametrize("sequence", list(SEQUENCES))
def test_recalled_casts_and_writes_follow_changes(sequence: str) -> None:
    step, params, grads, state = _warmed()
    clone = functopt.testing.clone_tree
    for move in SEQUENCES[sequence]:
        if callable(move):
            move(step)
            continue
        given = dict(grads) if move is None else {
            **grads, **{k: grads[k].float() for k in move.split(",")}}
        ref = clone(params), clone(given), clone(state)
        with torch.no_grad():
            expected = _outcome(lambda ref=ref: _step().step(ref[1], ref[2], ref[0]))
            params, state = step.step(given, state, params)
            now = params, state
            got = _outcome(lambda now=now: now)
        _same(got, expected)
