"""Rank-side checks of ZeRO-1 checkpoints: saved on 2 ranks, loaded on 2, 1 and 4.

``save_and_reload`` (2 ranks) trains ``SAVE_STEPS`` steps with
[`zero1`][functopt.distributed.zero1], saves with ``torch.distributed.checkpoint`` through
``zero1_state_to_dict``, then loads into a fresh template on the same 2 ranks (bitwise the
saved state) and trains ``MORE_STEPS`` more. ``load_and_continue`` does the load and the
further steps on another data-parallel size (4 ranks, or 1 process without
``torch.distributed``). The training includes an overflow step (skip counter 1, loss scale
halved) and loss-scale growth, so the counters and the scale travel with the checkpoint.

``tp_save_and_reload`` / ``tp_load_and_continue`` do the same for ZeRO-1 beside tensor
parallelism: saved on a (2, 2) (dp, tp) mesh, reloaded there bitwise, and continued on a
(1, 2) mesh bitwise as the one-process run (no clipping, pure path: elementwise).

The reference is the uninterrupted unsharded run: ``mixed_precision`` with the same
arguments on the whole params for all ``SAVE_STEPS + MORE_STEPS`` steps, computed in each
rank. Two configurations:

- ``pure``: ``fused=False``, no clipping. The step is elementwise after one global
  decision, so every rank's params, masters and moments are bitwise the reference's
  slices, whatever the data-parallel size (only the metric ``grad_norm`` is summed in
  another order: ``rtol=1e-6``).
- ``fused_clipped``: the fused kernel and ``max_grad_norm``. The norm is summed per slice,
  and the CPU kernel rounds a tensor's vector body and tail differently, so a slice
  boundary moves last bits: compared to ``rtol=1e-5`` (float32 rounding, amplified by
  Adam's division by the root of the second moment over a few steps).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import functopt
from distributed import harness
from distributed.checks import _assert_tree
from distributed.zero_checks import _params, _sharded_state_like
from functopt.distributed import (
    slice_bounds,
    zero1,
    zero1_state_from_dict,
    zero1_state_to_dict,
)
from functopt.precision import mixed_precision

SAVE_STEPS = 3
MORE_STEPS = 3
OVERFLOW_STEP = 1
CONFIGS = {"pure": {"fused": False, "max_grad_norm": None},
           "fused_clipped": {"fused": True, "max_grad_norm": 0.05}}


def _kwargs(config: str) -> dict[str, Any]:
    return {"loss_scale": functopt.dynamic_loss_scale(init_scale=2.0**6, growth_interval=2),
            **CONFIGS[config]}


def _zero1(config: str) -> functopt.precision.MixedPrecisionTransformation:
    return zero1(functopt.adamw(1e-2, weight_decay=0.1), **_kwargs(config))


def _grads(step: int, params: dict[str, Any], scale: torch.Tensor) -> dict[str, Any]:
    g = torch.Generator().manual_seed(2000 + step)  # the same on every rank (as after DDP)
    out = {k: None if p is None else (torch.randn(p.shape, generator=g) * scale).to(p.dtype)
           for k, p in params.items()}
    if step == OVERFLOW_STEP:
        out["w"].view(-1)[4] = float("inf")
    return out


def _train(opt: Any, params: Any, state: Any, steps: range) -> tuple[Any, Any]:
    for step in steps:
        params, state = opt.step(_grads(step, params, state.loss_scale.scale), state, params)
    return params, state


def _reference(config: str, steps: int) -> tuple[Any, Any]:
    ref = mixed_precision(functopt.adamw(1e-2, weight_decay=0.1), **_kwargs(config))
    params = _params()
    return _train(ref, params, ref.init(params), range(steps))


def _assert_like_reference(config: str, params: Any, state: Any, ref_params: Any,
                           ref_state: Any, rank: int, world: int) -> None:
    bitwise = config == "pure"
    tol = {"rtol": 1e-5, "atol": 1e-7}
    _assert_tree(params, ref_params, bitwise=bitwise, **tol)
    expected = _sharded_state_like(ref_state, rank, world)
    _assert_tree(state.master, expected.master, bitwise=bitwise, **tol)
    _assert_tree(state.inner_state, expected.inner_state, bitwise=bitwise, **tol)
    _assert_tree(state.loss_scale, expected.loss_scale)  # scale, growth tracker: bitwise
    assert int(state.metrics.skipped_steps) == int(ref_state.metrics.skipped_steps) == 1
    assert torch.equal(state.metrics.num_zeros, ref_state.metrics.num_zeros)
    assert torch.equal(state.key, ref_state.key)
    torch.testing.assert_close(state.metrics.grad_norm, ref_state.metrics.grad_norm,
                               rtol=1e-6, atol=0.0)




def _raises(kind: type[Exception], pattern: str, fn: Callable[..., Any], *args: Any) -> None:
    """``fn(*args)`` raises ``kind`` matching ``pattern`` (an ``AssertionError`` otherwise:
    ``pytest.raises``'s "did not raise" is no ``Exception`` for ``_run`` to report)."""
    try:
        fn(*args)
    except kind as exc:
        assert re.search(pattern, str(exc)), f"{exc!r} does not match {pattern!r}"
        return
    raise AssertionError(f"{fn.__name__} did not raise {kind.__name__}")


def _present(params: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: p for k, p in params.items() if p is not None}  # DCP would pickle a None


def _load(config: str, path: str) -> tuple[Any, Any, Any]:
    """A fresh template on these ranks, loaded from the checkpoint: (opt, params, state)."""
    opt = _zero1(config)
    params = {k: None if p is None else torch.zeros_like(p) for k, p in _params().items()}
    template = opt.init(params)  # zeros: only the checkpoint can give the right values
    loaded = {"params": _present(params), "opt": zero1_state_to_dict(template, params)}
    dcp.load(loaded, checkpoint_id=os.path.join(path, config))
    params = {**params, **loaded["params"]}
    return opt, params, zero1_state_from_dict(loaded["opt"], template, params)


# --------------------------------------------------------------------------- 2 ranks

def save_and_reload(rank: int, world: int, path: str) -> dict[str, str | None]:
    """Train, save; reload on the same ranks (bitwise) and train on; the keys and shards."""

    def run(config: str) -> None:
        opt = _zero1(config)
        params = _params()
        params, state = _train(opt, params, opt.init(params), range(SAVE_STEPS))
        d = zero1_state_to_dict(state, params)
        # every slice of a param's state is a Shard(0) DTensor of the flattened leaf whose
        # local shard is the rank's slice (no copy), at slice_bounds' offset
        from torch.distributed.tensor import DTensor, Shard
        sliced = [k for k in d if k.startswith(("master.", "inner_state.0.mu.",
                                                "inner_state.0.nu."))]
        assert len(sliced) == 3 + 2 * 5, sliced  # masters of 3 bfloat16 leaves; mu, nu of 5
        for key in sliced:
            value, name = d[key], key.rsplit(".", 1)[1]
            assert isinstance(value, DTensor) and value.placements == (Shard(0),), key
            assert value.shape == (params[name].numel(),), key
            start, end = slice_bounds(params[name].numel(), rank, world)
            assert value.to_local().shape == (end - start,), key
        assert not any(isinstance(v, DTensor) for k, v in d.items() if k not in sliced)
        dcp.save({"params": _present(params), "opt": d}, checkpoint_id=os.path.join(path, config))
        ref_params, ref_state = _reference(config, SAVE_STEPS)
        _assert_like_reference(config, params, state, ref_params, ref_state, rank, world)
        # the same data-parallel size: the saved state comes back bitwise, every rank its own
        # slices (a plain-tensor save would keep one rank's copy under each key)
        opt2, params2, state2 = _load(config, path)
        _assert_tree(params2, params)
        _assert_tree(state2, state)
        params2, state2 = _train(opt2, params2, state2, range(SAVE_STEPS, SAVE_STEPS + MORE_STEPS))
        params, state = _train(opt, params, state, range(SAVE_STEPS, SAVE_STEPS + MORE_STEPS))
        _assert_tree(params2, params)  # bitwise the uninterrupted zero1 run
        _assert_tree(state2, state)
        ref_params, ref_state = _reference(config, SAVE_STEPS + MORE_STEPS)
        _assert_like_reference(config, params2, state2, ref_params, ref_state, rank, world)

    def generic_helpers_refuse_zero1_state() -> None:
        """Saved as plain tensors (``state_to_dict``), every rank's slice would have the same
        key and DCP would keep one rank's: a same-size reload would give some rank another
        rank's slice without a word. The generic helpers refuse the state and the template."""
        from functopt.distributed import state_from_dict, state_to_dict
        opt = _zero1("pure")
        params = {"w": torch.arange(8.0)}  # slices of 4 and 4: equal shapes, other values
        params, state = _train(opt, params, opt.init(params), range(1))
        _raises(TypeError, r"state_to_dict: the state is the state of zero1.*Fix: use "
                           r"zero1_state_to_dict\(state, params\)", state_to_dict, state, params)
        d = zero1_state_to_dict(state, params)
        _raises(TypeError, r"state_from_dict: the template is the state of zero1.*"
                           r"zero1_state_from_dict\(d, template", state_from_dict, d,
                opt.init(params))
        back = zero1_state_from_dict(d, opt.init(params), params)  # the zero1 pair: exact
        _assert_tree(back, state)

    checks: dict[str, Callable[[], None]] = {config: (lambda c=config: run(c)) for config in CONFIGS}
    return harness.run_named({**checks, "generic_helpers_refuse_zero1_state":
                 generic_helpers_refuse_zero1_state})


# --------------------------------------------------------------- another size (1, 4)

def load_and_continue(rank: int, world: int, path: str) -> dict[str, str | None]:
    """Load the 2-rank checkpoint on ``world`` ranks (1: no process group) and train on."""

    def run(config: str) -> None:
        opt, params, state = _load(config, path)
        ref_params, ref_state = _reference(config, SAVE_STEPS)
        # what was saved, resharded: bitwise the reference's slices (DCP copies bytes)
        bitwise_masters = _sharded_state_like(ref_state, rank, world)
        if config == "pure":
            _assert_tree(state.master, bitwise_masters.master)
            _assert_tree(state.inner_state, bitwise_masters.inner_state)
        _assert_like_reference(config, params, state, ref_params, ref_state, rank, world)
        params, state = _train(opt, params, state, range(SAVE_STEPS, SAVE_STEPS + MORE_STEPS))
        ref_params, ref_state = _reference(config, SAVE_STEPS + MORE_STEPS)
        _assert_like_reference(config, params, state, ref_params, ref_state, rank, world)

    return harness.run_named({config: (lambda c=config: run(c)) for config in CONFIGS})


# ------------------------------------------------- with tensor parallelism: (2, 2) -> (1, 2)

def _tp_setup(world: int) -> tuple[Any, dict[str, torch.Tensor], dict[str, Any]]:
    """A (world/2, 2) mesh, the model's whole params, and its params parallelized on "tp"."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from distributed.replication_checks import _model
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    model = _model()
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return mesh, full, {n: p.detach() for n, p in model.named_parameters()}


def _tp_kwargs() -> dict[str, Any]:
    return {"loss_scale": functopt.dynamic_loss_scale(init_scale=2.0**4, growth_interval=2),
            "fused": False}


def _tp_train(opt: Any, full: dict[str, torch.Tensor], params: Any, state: Any,
              steps: range) -> tuple[Any, Any]:
    from distributed.zero_checks import _tp_grads
    for step in steps:
        grads, _ = _tp_grads(step, full, params, float(state.loss_scale.scale))
        if step == OVERFLOW_STEP:
            grads["3.weight"][0, 0] = float("inf")  # the plain (left out) param: every rank
        params, state = opt.step(grads, state, params)
    return params, state


def _tp_reference(full: dict[str, torch.Tensor], steps: int) -> tuple[Any, Any]:
    from distributed.zero_checks import _tp_grads
    ref = mixed_precision(functopt.adamw(1e-2, weight_decay=0.1), **_tp_kwargs())
    params, state = full, ref.init(full)
    for step in range(steps):
        _, whole = _tp_grads(step, full, full, float(state.loss_scale.scale))
        if step == OVERFLOW_STEP:
            whole["3.weight"][0, 0] = float("inf")
        params, state = ref.step(whole, state, params)
    return params, state


def _tp_assert_like_reference(params: Any, state: Any, full: dict[str, torch.Tensor],
                              steps: int) -> None:
    from distributed.checks import _full
    ref_params, ref_state = _tp_reference(full, steps)
    # elementwise steps, no clipping: bitwise the one-process run, however sharded
    _assert_tree({k: _full(v) for k, v in params.items()}, ref_params)
    _assert_tree(state.loss_scale, ref_state.loss_scale)
    assert int(state.metrics.skipped_steps) == int(ref_state.metrics.skipped_steps) == 1


def _tp_load(world: int, path: str) -> tuple[Any, Any, Any, Any]:
    mesh, full, params = _tp_setup(world)
    opt = zero1(functopt.adamw(1e-2, weight_decay=0.1), process_group=mesh["dp"].get_group(),
                replicated=True, **_tp_kwargs())
    template = opt.init(params)
    loaded = {"opt": zero1_state_to_dict(template, params, process_group=mesh["dp"].get_group())}
    dcp.load(loaded, checkpoint_id=os.path.join(path, "tp"))
    state = zero1_state_from_dict(loaded["opt"], template, params,
                                  process_group=mesh["dp"].get_group())
    return opt, full, params, state


def tp_save_and_reload(rank: int, world: int, path: str) -> dict[str, str | None]:
    """ZeRO-1 x TP on a (2, 2) mesh: saved, reloaded on the same ranks bitwise."""

    def run() -> None:
        mesh, full, params = _tp_setup(world)
        dp = mesh["dp"].get_group()
        opt = zero1(functopt.adamw(1e-2, weight_decay=0.1), process_group=dp,
                    replicated=True, **_tp_kwargs())
        params, state = _tp_train(opt, full, params, opt.init(params), range(SAVE_STEPS))
        _tp_assert_like_reference(params, state, full, SAVE_STEPS)
        d = zero1_state_to_dict(state, params, process_group=dp)
        tp_rank = mesh["tp"].get_local_rank()
        assert f"master.0.weight@tp{tp_rank}" not in d  # float32 params: no master
        assert f"inner_state.0.mu.0.weight@tp{tp_rank}" in d
        assert "loss_scale.scale" in d
        dcp.save({"opt": d}, checkpoint_id=os.path.join(path, "tp"))
        _, _, _, state2 = _tp_load(world, path)
        _assert_tree(state2, state)  # bitwise, every rank its own slices back

    return harness.run_named({"tp": run})


def tp_load_and_continue(rank: int, world: int, path: str) -> dict[str, str | None]:
    """The (2, 2) checkpoint on a (1, 2) mesh: training continues as the one-process run."""

    def run() -> None:
        opt, full, params, state = _tp_load(world, path)
        # the params are not in the checkpoint: the run's own params after SAVE_STEPS
        ref_params, _ = _tp_reference(full, SAVE_STEPS)
        from torch.distributed.tensor import DTensor, distribute_tensor
        params = {k: distribute_tensor(ref_params[k], v.device_mesh, v.placements)
                  if isinstance(v, DTensor) else ref_params[k].clone()
                  for k, v in params.items()}
        params, state = _tp_train(opt, full, params, state,
                                  range(SAVE_STEPS, SAVE_STEPS + MORE_STEPS))
        _tp_assert_like_reference(params, state, full, SAVE_STEPS + MORE_STEPS)

    return harness.run_named({"tp": run})
