"""Rank-side checks of checkpoints that reshard (DCP) and of offloading, on gloo ranks.

The 2-rank launch (``save_all``) trains ``SAVE_STEPS`` steps and saves with
``torch.distributed.checkpoint`` into a directory; the 1- and 4-rank launches
(``load_all``) build a template on their own sharding, load, train ``MORE_STEPS`` more
steps and compare with an uninterrupted single-process run of all the steps, computed in
the rank itself on whole tensors. Two runs are checkpointed:

- functional: [`mixed_precision`][functopt.precision.mixed_precision] over ``adamw`` on
  bfloat16 params distributed ``Shard(0)`` (float32 master DTensors), saved through
  ``state_to_dict`` / ``state_from_dict``;
- facade: ``MixedPrecisionOptimizer`` on an FSDP2 model, saved as a DCP ``Stateful``
  next to the model's state dict;
- facade_dsd: the same through ``get_optimizer_state_dict`` / ``set_optimizer_state_dict``
  (and the model's), the layout DCP's helpers key by parameter names.

Gradients are synthetic (a function of the step and the param name, the same on every
world size) and set as DTensors with the params' placements, so no backward pass is run:
FSDP's gradient reduction sums in an order that depends on the world size, and with
synthetic gradients the sharded run is the single-process run bitwise (elementwise maths
on the shards; the one global reduction only decides the skip and no clipping is done).

Each launch function returns ``{check name: None or the failure's traceback}``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import functopt
from distributed import harness
from distributed.checks import _assert_tree, _full, _mesh, _mlp, _shard
from functopt import distributed as fdist
from functopt.precision import mixed_precision

SAVE_STEPS = 2
MORE_STEPS = 2




def _full_params() -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in _mlp(torch.bfloat16).named_parameters()}


def _grad(step: int, name: str, like: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + sum(map(ord, name)))
    return torch.randn(like.shape, generator=g).to(like.dtype)


def _transform():
    # The pure path: it is elementwise, so training resharded on 1, 2 or 4 ranks is bitwise
    # the same. (PyTorch's fused CPU kernel rounds a tensor's vector body and its tail
    # differently, so with fused=True another sharding changes last bits.)
    return mixed_precision(functopt.adamw(1e-2, weight_decay=0.1),
                           loss_scale=functopt.dynamic_loss_scale(init_scale=16.0), fused=False)


def _functional_steps(params: dict[str, Any], state: Any, steps: range, mesh=None):
    tx = _transform()
    for step in steps:
        grads = {k: _grad(step, k, _full(p)) for k, p in params.items()}
        if mesh is not None:
            grads = {k: distribute_tensor(g, mesh, params[k].placements) for k, g in grads.items()}
        params, state = tx.step(grads, state, params)
    return params, state


def _facade(model: torch.nn.Module) -> functopt.MixedPrecisionOptimizer:
    return functopt.MixedPrecisionOptimizer(
        model.named_parameters(), functopt.adamw(1e-2, weight_decay=0.1),
        loss_scale=functopt.dynamic_loss_scale(init_scale=16.0), fused=False)  # see _transform


def _facade_steps(model: torch.nn.Module, opt: functopt.MixedPrecisionOptimizer,
                  steps: range) -> None:
    for step in steps:
        for name, p in model.named_parameters():
            g = _grad(step, name, _full(p.detach()))
            p.grad = (distribute_tensor(g, p.device_mesh, p.placements)
                      if isinstance(p, DTensor) else g)
        current = opt.get_grad_norm()  # of these gradients, over the shards: one all-reduce
        assert opt.step()
        torch.testing.assert_close(current, opt.get_grad_norm(), rtol=1e-6, atol=0.0)
        opt.zero_grad()


def _assert_state(actual: Any, expected: Any) -> None:
    """Bitwise, except the metric ``grad_norm``: the global sum of squares adds the shards'
    partial sums in an order that depends on the world size (a few float32 ulps)."""
    if isinstance(actual, dict):  # the facade's nested state dict
        actual, expected = dict(actual), dict(expected)
        a_norm, e_norm = actual.pop("metrics")["grad_norm"], expected.pop("metrics")["grad_norm"]
    else:
        a_norm, e_norm = actual.metrics.grad_norm, expected.metrics.grad_norm
        actual = actual._replace(metrics=actual.metrics._replace(grad_norm=None))
        expected = expected._replace(metrics=expected.metrics._replace(grad_norm=None))
    _assert_tree(actual, expected)
    torch.testing.assert_close(a_norm, e_norm, rtol=1e-6, atol=0.0)


def _reference(total: int):
    """The uninterrupted single-process runs, on whole tensors."""
    full = _full_params()
    params, state = _functional_steps(full, _transform().init(full), range(total))
    model = _mlp(torch.bfloat16)
    opt = _facade(model)
    _facade_steps(model, opt, range(total))
    return params, state, model, opt


# --------------------------------------------------------------------------- save (2 ranks)

def save_all(rank: int, world: int, path: str) -> dict[str, str | None]:
    mesh = _mesh(world)

    def functional() -> None:
        params = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in _full_params().items()}
        params, state = _functional_steps(params, _transform().init(params), range(SAVE_STEPS),
                                          mesh)
        d = fdist.state_to_dict(state, params)
        assert all(isinstance(v, DTensor) for k, v in d.items() if k.startswith("master."))
        dcp.save({"params": params, "opt": d}, checkpoint_id=os.path.join(path, "functional"))

    def facade() -> None:
        model = _shard(_mlp(torch.bfloat16), mesh)
        opt = _facade(model)
        _facade_steps(model, opt, range(SAVE_STEPS))
        dcp.save({"model": model.state_dict(), "optim": opt},
                 checkpoint_id=os.path.join(path, "facade"))

    def offload_dtensor_state() -> None:
        params = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in _full_params().items()}
        params, state = _functional_steps(params, _transform().init(params), range(1), mesh)
        _, buffers = fdist.offload(state)
        host2, buffers2 = fdist.offload(state, buffers=buffers)
        assert all(a is b for a, b in zip(buffers, buffers2, strict=True))
        back = fdist.reload(host2)
        _assert_tree(back, state)  # bitwise, local shards and placements
        for (_, a), (_, b) in zip(functopt.tree._core.leaves_with_path(back),
                                  functopt.tree._core.leaves_with_path(state), strict=True):
            assert isinstance(a, DTensor) == isinstance(b, DTensor)
            if isinstance(a, DTensor):
                assert a.placements == b.placements and a.shape == b.shape
                assert a.device_mesh == b.device_mesh
        # host DTensors are views of the buffers
        host_locals = [fdist.local_tensor(x) for x in
                       functopt.tree._core.flatten(host2.state)[0] if x is not None]
        assert {t.data_ptr() for t in host_locals if t.numel()} <= {
            b.data_ptr() for b in buffers2 if b is not None and b.numel()}
        # training continues bitwise after offload + reload
        cont = _functional_steps(params, back, range(1, 3), mesh)
        ref = _functional_steps(params, state, range(1, 3), mesh)
        _assert_tree(cont, ref)

    def facade_offload_fsdp() -> None:
        model = _shard(_mlp(torch.bfloat16), mesh)
        opt = _facade(model)
        _facade_steps(model, opt, range(1))
        before = opt.state_dict()["state"]
        opt.offload_to_cpu()
        first = opt._offload_buffers
        opt.restore_from_cpu()
        opt.offload_to_cpu()
        assert all(a is b for a, b in zip(first, opt._offload_buffers, strict=True))
        opt.restore_from_cpu()
        _assert_tree(opt.state_dict()["state"], before)
        _facade_steps(model, opt, range(1, 3))
        ref_model = _shard(_mlp(torch.bfloat16), mesh)
        ref_opt = _facade(ref_model)
        _facade_steps(ref_model, ref_opt, range(3))
        _assert_tree(opt.state_dict()["state"], ref_opt.state_dict()["state"])
        _assert_tree(dict(model.named_parameters()), dict(ref_model.named_parameters()))

    def facade_dsd() -> None:  # through DCP's state-dict helpers, which reshard it
        model = _shard(_mlp(torch.bfloat16), mesh)
        opt = _facade(model)
        _facade_steps(model, opt, range(SAVE_STEPS))
        osd = get_optimizer_state_dict(model, opt)
        assert all(isinstance(entry["master"], DTensor) for entry in osd["state"].values())
        dcp.save({"model": get_model_state_dict(model), "optim": osd},
                 checkpoint_id=os.path.join(path, "facade_dsd"))

    def facade_parameter_state() -> None:  # Megatron's one file, written by rank 0
        model = _shard(_mlp(torch.bfloat16), mesh)
        opt = _facade(model)
        _facade_steps(model, opt, range(SAVE_STEPS))
        opt.save_parameter_state(os.path.join(path, "parameter_state.pt"))
        if rank == 0:
            whole = torch.load(os.path.join(path, "parameter_state.pt"), weights_only=True)
            shapes = {k: tuple(v.shape) for k, v in _full_params().items()}
            assert {k: tuple(e["master"].shape) for k, e in whole["state"].items()} == shapes

    def state_from_dict_sharding_errors() -> None:
        template = {"m": distribute_tensor(torch.zeros(4), mesh, [Shard(0)])}
        with pytest.raises(ValueError, match=r"'m' is a DTensor with placements \(Replicate"):
            fdist.state_from_dict({"m": distribute_tensor(torch.zeros(4), mesh, [Replicate()])},
                                  template)
        with pytest.raises(TypeError, match=r"'m' is a plain tensor but the template's is a "
                                            r"DTensor"):
            fdist.state_from_dict({"m": torch.zeros(4)}, template)

    return harness.run_named({"functional": functional, "facade": facade, "facade_dsd": facade_dsd,
                 "facade_parameter_state": facade_parameter_state,
                 "state_from_dict_sharding_errors": state_from_dict_sharding_errors,
                 "offload_dtensor_state": offload_dtensor_state,
                 "facade_offload_fsdp": facade_offload_fsdp})


# ------------------------------------------------------------------------ load (1, 4 ranks)

def load_all(rank: int, world: int, path: str) -> dict[str, str | None]:
    mesh = _mesh(world)
    total = SAVE_STEPS + MORE_STEPS
    ref_params, ref_state, ref_model, ref_opt = _reference(total)

    def functional() -> None:
        params = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in _full_params().items()}
        template = _transform().init(params)
        loaded = {"params": params, "opt": fdist.state_to_dict(template, params)}
        dcp.load(loaded, checkpoint_id=os.path.join(path, "functional"))
        state = fdist.state_from_dict(loaded["opt"], template)
        params = loaded["params"]
        assert all(isinstance(v, DTensor) and v.placements == (Shard(0),)
                   for v in state.master.values() if v is not None)
        params, state = _functional_steps(params, state, range(SAVE_STEPS, total), mesh)
        _assert_tree(params, ref_params)  # bitwise
        _assert_state(state, ref_state)

    def facade() -> None:
        model = _shard(_mlp(torch.bfloat16), mesh)
        for p in model.parameters():  # the checkpoint, not the init, must set them
            with torch.no_grad():
                p.zero_()
        opt = _facade(model)
        dcp.load({"model": model.state_dict(), "optim": opt},
                 checkpoint_id=os.path.join(path, "facade"))
        _facade_steps(model, opt, range(SAVE_STEPS, total))
        _assert_state(opt._state, ref_opt._state)
        _assert_tree(dict(model.named_parameters()), dict(ref_model.named_parameters()))

    def facade_dsd() -> None:
        model = _shard(_mlp(torch.bfloat16), mesh)
        for p in model.parameters():  # the checkpoint, not the init, must set them
            with torch.no_grad():
                p.zero_()
        opt = _facade(model)
        loaded = {"model": get_model_state_dict(model),
                  "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(loaded, checkpoint_id=os.path.join(path, "facade_dsd"))
        set_model_state_dict(model, loaded["model"])
        set_optimizer_state_dict(model, opt, loaded["optim"])
        assert opt.loss_scale == ref_loss_scale_after_save
        _facade_steps(model, opt, range(SAVE_STEPS, total))
        _assert_state(opt._state, ref_opt._state)  # masters, moments, loss scale, counters
        _assert_tree(dict(model.named_parameters()), dict(ref_model.named_parameters()))

    def facade_parameter_state() -> None:  # read by rank 0, sent to the others
        model = _shard(_mlp(torch.bfloat16), mesh)
        for p in model.parameters():  # the file (the masters), not the init, sets them
            with torch.no_grad():
                p.zero_()
        opt = _facade(model)
        opt.load_parameter_state(os.path.join(path, "parameter_state.pt"))
        assert opt.loss_scale == ref_loss_scale_after_save
        _facade_steps(model, opt, range(SAVE_STEPS, total))
        _assert_state(opt._state, ref_opt._state)
        _assert_tree(dict(model.named_parameters()), dict(ref_model.named_parameters()))

    ref_loss_scale_after_save = _after_save_loss_scale()
    return harness.run_named({"functional": functional, "facade": facade, "facade_dsd": facade_dsd,
                              "facade_parameter_state": facade_parameter_state})


def _after_save_loss_scale() -> float:
    """The loss scale of the uninterrupted facade run after ``SAVE_STEPS`` steps."""
    model = _mlp(torch.bfloat16)
    opt = _facade(model)
    _facade_steps(model, opt, range(SAVE_STEPS))
    return opt.loss_scale
