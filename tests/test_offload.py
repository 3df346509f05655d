"""offload / reload of functopt state, and the facade's offload_to_cpu / restore_from_cpu.

On this CPU build offloading copies into host buffers without pinning; the DTensor cases
(local shards offloaded, placements restored) run on gloo ranks in
``tests/distributed/checkpoint_checks.py`` (``test_distributed_checkpoint.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functopt
from functopt.distributed import OffloadedState, offload, reload
from functopt.precision import mixed_precision
from functopt.testing import assert_bitwise_equal, clone_tree, strategies


def _tx():
    return mixed_precision(functopt.adamw(1e-2, weight_decay=0.1),
                           loss_scale=functopt.dynamic_loss_scale(init_scale=16.0))


def _grads(step: int, params):
    g = torch.Generator().manual_seed(step)
    return {k: torch.randn(v.shape, generator=g).to(v.dtype) for k, v in params.items()}


def _params():
    torch.manual_seed(0)
    return {"w": torch.randn(4, 3).to(torch.bfloat16), "b": torch.randn(3), "e": torch.ones(0)}


@settings(max_examples=20, deadline=None)
@given(strategies.params(allow_none=True), st.sampled_from(["adam", "sgd"]))
def test_round_trip_bitwise_and_pure(params, name) -> None:
    tx = functopt.adam(0.1) if name == "adam" else functopt.sgd(0.1, momentum=0.9)
    state = tx.init(params)
    before = clone_tree(state)
    host, buffers = offload(state)
    assert isinstance(host, OffloadedState)
    assert_bitwise_equal(host.state, state)
    assert_bitwise_equal(reload(host, "cpu"), state)
    assert_bitwise_equal(state, before)
    leaves = functopt.tree._core.flatten(host.state)[0]
    assert all(a is b for a, b in zip(leaves, buffers, strict=True) if a is not None)


def test_buffers_reused_without_allocation() -> None:
    params = _params()
    tx = _tx()
    state = tx.init(params)
    _, buffers = offload(state)
    ptrs = [None if b is None else b.data_ptr() for b in buffers]
    _, state = tx.step(_grads(0, params), state, params)
    host, buffers2 = offload(state, buffers=buffers)
    assert all(a is b for a, b in zip(buffers, buffers2, strict=True))
    assert [None if b is None else b.data_ptr() for b in buffers2] == ptrs
    assert_bitwise_equal(host.state, state)  # the new values, in the old memory
    # the offloaded copy does not alias the live state, even for leaves already on the CPU
    live = {t.data_ptr() for t in functopt.tree._core.flatten(state)[0]
            if t is not None and t.numel()}
    assert not live & {p for p in ptrs if p is not None}
    assert not any(b.is_pinned() for b in buffers2 if b is not None) or torch.cuda.is_available()


def test_training_continues_bitwise_after_offload_and_reload() -> None:
    tx = _tx()
    params = _params()
    state = tx.init(params)
    params, state = tx.step(_grads(0, params), state, params)
    host, _ = offload(state)
    resumed = reload(host)
    ref_params, ref_state = params, state
    for step in (1, 2):
        params, resumed = tx.step(_grads(step, params), resumed, params)
        ref_params, ref_state = tx.step(_grads(step, ref_params), ref_state, ref_params)
    assert_bitwise_equal(params, ref_params)
    assert_bitwise_equal(resumed, ref_state)


def test_reload_into_donated_buffers_and_devices() -> None:
    tx = _tx()
    params = _params()
    state = tx.init(params)
    host, _ = offload(state)
    assert all(d == torch.device("cpu") for d in host.devices if d is not None)
    first = reload(host)
    donated = clone_tree(first)
    second = reload(host, "cpu", buffers=donated)
    assert_bitwise_equal(second, state)
    a = [x for x in functopt.tree._core.flatten(second)[0] if x is not None]
    b = [x for x in functopt.tree._core.flatten(donated)[0] if x is not None]
    assert all(x is y for x, y in zip(a, b, strict=True))


def test_errors() -> None:
    state = functopt.adam(0.1).init({"w": torch.ones(2)})
    host, buffers = offload(state)
    with pytest.raises(ValueError, match=r"buffers must be the tuple of 3 entries"):
        offload(state, buffers=buffers[:2])
    with pytest.raises(TypeError, match=r"buffers must be the tuple a previous call returned"):
        offload(state, buffers=list(buffers))  # another kind of value: TypeError
    with pytest.raises(ValueError, match=r"host buffer for '0.mu.w' is a float32 tensor of "
                                         r"shape \(3,\), but the leaf is a float32 tensor of "
                                         r"shape \(2,\)"):
        offload(state, buffers=(buffers[0], torch.ones(3), buffers[2]))
    with pytest.raises(TypeError, match=r"state leaf 'x' is a str"):
        offload({"x": "s"})
    with pytest.raises(TypeError, match="expected the OffloadedState"):
        reload(state, "cpu")
    with pytest.raises(ValueError, match=r"device buffer for '0.nu.w'"):
        wrong = (state[0]._replace(nu={"w": torch.ones(2, dtype=torch.float64)}), *state[1:])
        reload(host, "cpu", buffers=type(state)(wrong) if not hasattr(state, "_fields")
               else state._make(wrong))


def test_facade_offload_to_cpu_and_restore() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    ref = torch.nn.Linear(3, 2).to(torch.bfloat16)
    ref.load_state_dict(model.state_dict())
    opts = [functopt.MixedPrecisionOptimizer(m.named_parameters(), functopt.adamw(1e-2))
            for m in (model, ref)]
    x = torch.randn(4, 3).to(torch.bfloat16)
    buffers = None
    for step in range(3):
        for m, opt in zip((model, ref), opts, strict=True):
            opt.backward(m(x * (step + 1)).float().square().mean())
            assert opt.step()
            opt.zero_grad()
        opt = opts[0]
        before = {k: v for k, v in functopt.tree._core.leaves_with_path(opt.state_dict())}
        opt.offload_to_cpu()
        opt.offload_to_cpu()  # a second call does nothing
        if buffers is not None:
            assert all(a is b for a, b in zip(buffers, opt._offload_buffers, strict=True))
        buffers = opt._offload_buffers
        assert opt.loss_scale == 65536.0  # read from the host copy
        with pytest.raises(RuntimeError, match=r"step: the optimizer state is offloaded"):
            opt.step()
        with pytest.raises(RuntimeError, match="restore_from_cpu"):
            opt.load_state_dict(before)  # (a state_dict() now would own the host buffers)
        opt.restore_from_cpu("cpu" if step % 2 else None)  # the params' device, or None
        with pytest.raises(RuntimeError, match=r"restore_from_cpu: the state is not offloaded"):
            opt.restore_from_cpu()  # a second call, without an offload between
        after = dict(functopt.tree._core.leaves_with_path(opt.state_dict()))
        assert_bitwise_equal(after, before)
    assert_bitwise_equal(opts[0].state_dict(), opts[1].state_dict())
    assert_bitwise_equal(dict(model.named_parameters()), dict(ref.named_parameters()))


@pytest.mark.parametrize(("device_id", "error", "match"), [
    ("meta", ValueError, r"device_id='meta', but the state came from cpu, where the params"),
    (torch.device("meta"), ValueError, r"device_id=device\(type='meta'\), but the state came"),
    (0, ValueError, r"device_id=0"),  # an accelerator index: none here, or not the params'
    (1.5, TypeError, r"device_id must be a torch.device, a str, an int or None, got float"),
    (True, TypeError, r"device_id must be a torch.device, a str, an int or None, got bool"),
])
def test_facade_restore_from_cpu_refuses_another_device(device_id: Any, error: type,
                                                       match: str) -> None:
    """The state goes back beside its params: another device raises, and the state stays
    offloaded (a corrected call then restores it bitwise)."""
    w = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    opt = functopt.MixedPrecisionOptimizer([("w", w)], functopt.adamw(1e-2))
    w.grad = torch.full((3,), 0.5, dtype=torch.bfloat16)
    opt.step()
    before = opt.state_dict()
    opt.offload_to_cpu()
    with pytest.raises(error, match=match):
        opt.restore_from_cpu(device_id)
    with pytest.raises(RuntimeError, match=r"step: the optimizer state is offloaded"):
        opt.step()
    opt.restore_from_cpu("cpu")
    assert_bitwise_equal(opt.state_dict(), before)
