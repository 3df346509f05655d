"""functopt.optim.Adafactor against torch.optim.Adafactor.

The law: for any params (0-d, vectors, matrices, batches of matrices, empty-free shapes of
up to four dims, transposed and strided leaves) and any options torch accepts, ten steps
of the drop-in train the params as torch's for-loop and foreach implementations do, in
float64 to 1e-12 of the largest param. The rest checks the drop-in's contract beyond
the shared tests of tests/test_optim.py (optim_db's rows and errors, signatures),
tests/test_optim_torch_state.py (state dicts both ways) and
tests/test_optim_missing_grads.py (per-param steps): per-group options, fixed options,
float32, the rule's in-place and autograd forms, and gradients through it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functopt
from functopt import optim
from functopt.optim._adafactor import scale_by_torch_adafactor

STEPS = 10


def _make(shape: tuple[int, ...], layout: str, g: torch.Generator,
          dtype: torch.dtype) -> torch.nn.Parameter:
    if layout == "transposed" and len(shape) >= 2:
        base = torch.randn(shape[::-1], generator=g, dtype=dtype)
        return torch.nn.Parameter(base.transpose(0, -1) if len(shape) == 2 else
                                  base.permute(*reversed(range(len(shape)))))
    if layout == "strided" and len(shape) >= 1:
        wide = torch.randn((*shape[:-1], 2 * shape[-1]), generator=g, dtype=dtype)
        return torch.nn.Parameter(wide[..., ::2])
    return torch.nn.Parameter(torch.randn(shape, generator=g, dtype=dtype))


def _params(shapes: list[tuple[int, ...]], layouts: list[str], seed: int = 0,
            dtype: torch.dtype = torch.float64) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [_make(s, lay, g, dtype) for s, lay in zip(shapes, layouts, strict=True)]


def _train(opt: torch.optim.Optimizer, ps: list[torch.nn.Parameter], steps: int = STEPS,
           scale: float = 1.0, holes: bool = False) -> None:
    for t in range(steps):
        g = torch.Generator().manual_seed(100 + t)
        for p in ps:
            p.grad = scale * torch.randn(p.shape, generator=g, dtype=p.dtype)
            if holes and p.dim() > 1:  # a row and a column that get no gradient
                p.grad[..., 0, :] = 0.0
                p.grad[..., :, -1] = 0.0
        opt.step()


def _worst(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    scale = max(1.0, *(float(x.detach().abs().max()) for x in b if x.numel()))
    return max(float((x - y).detach().abs().max()) if x.numel() else 0.0
               for x, y in zip(a, b, strict=True)) / scale


_SHAPES = st.lists(st.lists(st.integers(1, 5), min_size=0, max_size=4).map(tuple),
                   min_size=1, max_size=4)
_OPTIONS = st.fixed_dictionaries({}, optional={
    "lr": st.sampled_from([1e-3, 1e-2, 0.3, 2.0]),
    "beta2_decay": st.sampled_from([-0.8, -1.0, -0.5, 0.0]),
    "eps": st.sampled_from([(None, 1e-3), (1e-30, 1e-3), (1e-3, 0.0), (0.0, 1e-2),
                            (0.5, 1e-3)]),
    "d": st.sampled_from([1.0, 1.5, 10.0]),
    "weight_decay": st.sampled_from([0.0, 0.1]),
    "maximize": st.booleans(),
})


@settings(max_examples=40, deadline=None)
@given(shapes=_SHAPES, options=_OPTIONS, data=st.data())
def test_trains_as_torch_for_any_params_and_options(shapes: list[tuple[int, ...]],
                                                   options: dict[str, Any],
                                                   data: st.DataObject) -> None:
    layouts = data.draw(st.lists(st.sampled_from(["plain", "transposed", "strided"]),
                                 min_size=len(shapes), max_size=len(shapes)))
    foreach = data.draw(st.booleans())
    # larger gradients where eps1 is large, so that its floor is met on both sides
    scale = data.draw(st.sampled_from([1.0, 1e-3, 1e3]))
    # rows and columns without gradient: the floor eps1**2 of the estimate is met there
    holes = data.draw(st.booleans())
    ours = _params(shapes, layouts)
    theirs = _params(shapes, layouts)
    _train(optim.Adafactor(ours, **options), ours, scale=scale, holes=holes)
    _train(torch.optim.Adafactor(theirs, foreach=foreach, **options), theirs, scale=scale,
           holes=holes)
    assert _worst(ours, theirs) <= 1e-12
    start = _params(shapes, layouts)
    # (the run moved a param, unless the holes cover every gradient)
    assert holes or any(not torch.equal(p, s) for p, s in zip(theirs, start, strict=True))


def test_float32_steps_stay_within_float32_rounding_of_torch() -> None:
    shapes, layouts = [(64, 48), (48,), (3, 16, 8)], ["plain"] * 3
    ours = _params(shapes, layouts, dtype=torch.float32)
    theirs = _params(shapes, layouts, dtype=torch.float32)
    _train(optim.Adafactor(ours, weight_decay=0.1), ours)
    _train(torch.optim.Adafactor(theirs, weight_decay=0.1), theirs)
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)


def test_groups_with_their_own_lr_beta2_decay_d_and_weight_decay_match_torch() -> None:
    shapes, layouts = [(4, 3), (5,), (2, 3, 4)], ["plain"] * 3

    def groups(ps: list[torch.nn.Parameter]) -> list[dict[str, Any]]:
        return [{"params": [ps[0]], "lr": 0.3, "d": 2.0},
                {"params": [ps[1]], "beta2_decay": -0.5, "weight_decay": 0.2},
                {"params": [ps[2]]}]

    ours, theirs = _params(shapes, layouts), _params(shapes, layouts)
    opt = optim.Adafactor(groups(ours), lr=0.05)
    ref = torch.optim.Adafactor(groups(theirs), lr=0.05)
    _train(opt, ours, steps=4)
    _train(ref, theirs, steps=4)
    for o, r in zip(opt.param_groups, ref.param_groups, strict=True):  # a scheduler's move
        o["lr"] = r["lr"] = r["lr"] * 0.5
    _train(opt, ours, steps=4)
    _train(ref, theirs, steps=4)
    assert _worst(ours, theirs) <= 1e-12
    assert [sorted(g) for g in opt.param_groups] == [sorted(g) for g in ref.param_groups]


@pytest.mark.parametrize(("key", "value"), [("eps", (1e-3, 10.0)), ("maximize", True)])
def test_groups_with_their_own_eps_or_maximize_match_torch(key: str, value: Any) -> None:
    shapes, layouts = [(4, 3), (5,), (2, 3, 4)], ["plain"] * 3

    def groups(ps: list[torch.nn.Parameter]) -> list[dict[str, Any]]:
        return [{"params": ps[:1]}, {"params": ps[1:], key: value}]

    ours, theirs = _params(shapes, layouts), _params(shapes, layouts)
    _train(optim.Adafactor(groups(ours)), ours, steps=4)
    _train(torch.optim.Adafactor(groups(theirs)), theirs, steps=4)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    alone = _params(shapes, layouts)
    _train(optim.Adafactor(alone), alone, steps=4)
    assert torch.equal(alone[0], ours[0])
    assert not torch.equal(alone[1], ours[1])


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"eps": 1e-3}, "eps must be a pair"),
    ({"eps": (None, -1.0)}, "epsilon2 should be >= 0"),
    ({"weight_decay": -0.1}, "weight_decay should be >= 0"),
    ({"lr": -1.0}, "Learning rate should be >= 0"),
    ({"lr": torch.tensor([0.1, 0.2])}, "Tensor lr must be 1-element"),
    ({"maximize": "yes"}, "maximize"),
])
def test_bad_options_are_refused_naming_them(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        optim.Adafactor([torch.nn.Parameter(torch.ones(2))], **kwargs)


def test_a_group_value_out_of_range_is_refused_at_the_step() -> None:
    p = torch.nn.Parameter(torch.ones(2, 2))
    opt = optim.Adafactor([p])
    p.grad = torch.ones(2, 2)
    opt.param_groups[0]["d"] = 0.5
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['d'\] is 0.5"):
        opt.step()


def test_a_sparse_gradient_is_refused_as_torch_refuses_it() -> None:
    for cls in (optim.Adafactor, torch.optim.Adafactor):
        p = torch.nn.Parameter(torch.ones(3, 2))
        p.grad = torch.ones(3, 2).to_sparse()
        with pytest.raises(RuntimeError, match="Adafactor does not support sparse gradients"):
            cls([p]).step()


def _rule_inputs() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    params = {"m": torch.randn(3, 4, generator=g, dtype=torch.float64),
              "v": torch.randn(5, generator=g, dtype=torch.float64),
              "s": torch.randn((), generator=g, dtype=torch.float64)}
    grads = {k: torch.randn(v.shape, generator=g, dtype=torch.float64)
             for k, v in params.items()}
    return params, grads


@settings(max_examples=30, deadline=None)
@given(shapes=_SHAPES, options=_OPTIONS, data=st.data())
def test_the_rule_gives_the_same_bits_in_place_and_under_autograd(
        shapes: list[tuple[int, ...]], options: dict[str, Any], data: st.DataObject) -> None:
    # The step's form (foreach, in place, runs of leaves) against the per-leaf form autograd
    # takes, over three updates of drawn params (transposed, strided, 0-d, rows and columns
    # without gradient) and options: bitwise.
    layouts = data.draw(st.lists(st.sampled_from(["plain", "transposed", "strided"]),
                                 min_size=len(shapes), max_size=len(shapes)))
    holes = data.draw(st.booleans())
    eps1, eps2 = options.get("eps", (None, 1e-3))
    tx = scale_by_torch_adafactor(options.get("lr", 1e-2), options.get("beta2_decay", -0.8),
                                  options.get("d", 1.0), options.get("weight_decay") or None,
                                  eps1=eps1, eps2=eps2)
    params = {f"p{i}": p.detach() for i, p in enumerate(_params(shapes, layouts))}
    fast_state = slow_state = tx.init(params)
    for t in range(3):
        g = torch.Generator().manual_seed(100 + t)
        grads = {k: torch.randn(p.shape, generator=g, dtype=p.dtype) for k, p in params.items()}
        if holes:
            for v in grads.values():
                if v.dim() > 1:
                    v[..., 0, :] = 0.0
        with torch.no_grad():
            fast, fast_state = tx.update(grads, fast_state, params)
        slow, slow_state = tx.update(grads, slow_state, params)
        for k in params:
            assert torch.equal(fast[k], slow[k]), (t, k)
        for a, b in zip(functopt.tree.flatten(fast_state)[0],
                        functopt.tree.flatten(slow_state)[0], strict=True):
            assert (a is None and b is None) or torch.equal(a, b)
        params = {k: p + fast[k] for k, p in params.items()}


def test_gradients_flow_through_the_rule() -> None:
    tx = scale_by_torch_adafactor(0.1, -0.8, 1.5, 0.05, eps2=1e-3)
    params, grads = _rule_inputs()
    state = tx.update(grads, tx.init(params), params)[1]  # a step in, so the EMAs are set

    def update(m: torch.Tensor, v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = tx.update({"m": m, "v": v, "s": s}, state, params)[0]
        return out["m"], out["v"], out["s"]

    inputs = tuple(grads[k].clone().requires_grad_() for k in ("m", "v", "s"))
    assert torch.autograd.gradcheck(update, inputs)


def test_a_param_stepped_by_torch_then_by_functopt_continues_torchs_run() -> None:
    shapes, layouts = [(4, 3), (3,)], ["plain"] * 2
    ours, theirs = _params(shapes, layouts), _params(shapes, layouts)
    ref = torch.optim.Adafactor(theirs, weight_decay=0.1)
    _train(ref, theirs, steps=3)
    with torch.no_grad():
        for o, t in zip(ours, theirs, strict=True):
            o.copy_(t)
    opt = optim.Adafactor(ours, weight_decay=0.1)
    opt.load_state_dict(ref.state_dict())
    _train(opt, ours, steps=3)
    _train(ref, theirs, steps=3)
    assert _worst(ours, theirs) <= 1e-12
    state = opt.state_dict()["state"]
    assert sorted(state[0]) == ["col_var", "row_var", "step"]
    assert sorted(state[1]) == ["step", "variance"]
    assert state[0]["row_var"].shape == (4, 1) and state[0]["col_var"].shape == (1, 3)
    assert float(state[0]["step"]) == 6.0


def test_the_floor_checked_on_every_leaf_gives_the_same_bits() -> None:
    # Where the check cannot read back to the host (compiling, recording a CUDA graph),
    # every matrix takes the floored form: the same bits as the checked step.
    from unittest import mock

    tx = scale_by_torch_adafactor(0.1, -0.8, 1.0, None, eps2=1e-3)
    params, grads = _rule_inputs()
    grads["m"][1] = 0.0  # a row without gradient: this matrix meets the floor
    params["w"] = torch.randn(6, 5, dtype=torch.float64)  # and this one does not
    grads["w"] = torch.randn(6, 5, dtype=torch.float64)
    state = tx.init(params)
    with torch.no_grad():
        checked = tx.update(grads, state, params)[0]
        with mock.patch.object(torch.compiler, "is_compiling", return_value=True):
            every = tx.update(grads, state, params)[0]
    for k in params:
        assert torch.equal(checked[k], every[k]), k
    assert bool(checked["m"][1].eq(0).all()) and bool(checked["m"].isfinite().all())


@settings(max_examples=25, deadline=None)
@given(shapes=_SHAPES, options=_OPTIONS, data=st.data())
def test_the_drop_in_step_is_the_pure_update_and_apply_bitwise(
        shapes: list[tuple[int, ...]], options: dict[str, Any], data: st.DataObject) -> None:
    # The drop-in adds each run's updates into its params as the rule goes (runs of a few
    # elements here, so that there are several): the same bits as the class's transform's
    # pure update followed by the additions, over three steps (params of the same layouts
    # on both sides: a norm's order of additions follows the layout).
    from functopt.optim import _adafactor

    layouts = data.draw(st.lists(st.sampled_from(["plain", "transposed", "strided"]),
                                 min_size=len(shapes), max_size=len(shapes)))
    cap = data.draw(st.sampled_from([1, 16, 1 << 20]))
    before = dict(_adafactor._RUN_ELEMENTS)
    _adafactor._RUN_ELEMENTS["cpu"] = cap
    try:
        ps = _params(shapes, layouts)
        opt = optim.Adafactor(ps, **options)
        params = [p.detach() for p in _params(shapes, layouts)]
        tx = opt.transform
        state = tx.init(params)
        for t in range(3):
            g = torch.Generator().manual_seed(100 + t)
            grads = [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in ps]
            for p, grad in zip(ps, grads, strict=True):
                p.grad = grad.clone()
            opt.step()
            with torch.no_grad():
                updates, state = tx.update(grads, state, params)
            torch._foreach_add_(params, functopt.tree.flatten(updates)[0])
            for p, q in zip(ps, params, strict=True):
                assert torch.equal(p.detach(), q), t
    finally:
        _adafactor._RUN_ELEMENTS.clear()
        _adafactor._RUN_ELEMENTS.update(before)
