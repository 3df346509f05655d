"""MixedPrecisionOptimizer: the LightRFT/Megatron-style facade over the mixed-precision step.

Parity with torch.amp.GradScaler + torch.optim.AdamW, bitwise equality with the functional
step it drives, exact master weights for bfloat16 models, bitwise continuation after a
checkpoint round trip, and every error it raises.
"""

from __future__ import annotations

import copy
import io
import math
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import functopt
from functopt.adapters import MixedPrecisionOptimizer, _state_dict
from functopt.precision import mixed_precision
from functopt.testing import strategies as fst
from functopt.tree import _core

LOW = (torch.float16, torch.bfloat16)


def _mlp(dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
    ).to(dtype)


def _data(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 4, generator=g)
    return x.to(dtype), (x.sum(dim=1, keepdim=True).sin()).to(dtype)


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x).float() - y.float()).pow(2).mean()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _nested(opt: MixedPrecisionOptimizer) -> dict[str, Any]:
    """The facade's step state as nested dicts keyed by field and param names (the state
    dict's format is tested in test_state_codec)."""
    return _state_dict.to_nested("test", opt._state)


def _plain_view(nested: dict[str, Any]) -> tuple[dict[str, Any], Any, dict[str, Any]]:
    """A plain recipe's facade state (the facade runs it as ``inject_hyperparams`` of
    itself) split into the state of the plain functional step (the recipe's own state at
    ``inner_state``), the injected count, and the injected hyperparameters."""
    lifted = nested["inner_state"]
    assert set(lifted) <= {"count", "hyperparams", "inner_state"}
    plain = {k: v for k, v in nested.items() if k != "inner_state"}
    if "inner_state" in lifted:  # (a stateless recipe has none: to_nested leaves it out)
        plain["inner_state"] = lifted["inner_state"]
    return plain, lifted["count"], lifted["hyperparams"]


def _same_nested(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            _same_nested(a[k], b[k]) for k in a
        )
    if isinstance(a, list):  # the group values
        return isinstance(b, list) and len(a) == len(b) and all(map(_same_nested, a, b))
    if not isinstance(a, torch.Tensor):
        return type(a) is type(b) and a == b
    return isinstance(b, torch.Tensor) and _same_bits(a, b)


def _roundtrip(obj: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


# -- the public surface ---------------------------------------------------------------


def test_top_level_export() -> None:
    assert functopt.MixedPrecisionOptimizer is MixedPrecisionOptimizer
    assert "MixedPrecisionOptimizer" in functopt.__all__
    assert "MixedPrecisionOptimizer" in functopt.adapters.__all__


# -- parity with torch.amp.GradScaler + torch.optim.AdamW -----------------------------

# step -> what goes wrong: the loss times inf (inf/nan grads), or a nan put into one grad.
_FAULTS = {3: "inf", 4: "nan", 9: "grad_nan", 13: "inf", 14: "inf", 15: "inf", 22: "grad_nan"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_parity_with_gradscaler_and_adamw(dtype: torch.dtype) -> None:
    """Same scale trajectory and skip decisions, bitwise; params equal to a few ulp.

    Tolerance: functopt.adamw computes ``-lr * (adam + wd * p)`` where torch.optim.AdamW
    computes ``p * (1 - lr * wd)`` then ``addcdiv``; the unscaled gradients are bitwise the
    same (both multiply by ``float32(1 / scale)``), so the params differ only by that
    rounding, a few ulp over 30 steps (observed: 4e-7 in float32, 3e-16 in float64).
    """
    model = _mlp(dtype)
    ref = copy.deepcopy(model)
    x, y = _data(dtype)
    opt = MixedPrecisionOptimizer(
        model.named_parameters(), functopt.adamw(1e-2, weight_decay=0.1),
        loss_scale=functopt.dynamic_loss_scale(init_scale=2.0**10, growth_interval=3),
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-12,
                                                                        "atol": 1e-14}
    scales, skips = [], []
    for t in range(30):
        fault = _FAULTS.get(t)
        factor = {"inf": math.inf, "nan": math.nan}.get(fault or "", 1.0)
        opt.backward(_loss(model, x, y) * factor)
        scaler.scale(_loss(ref, x, y) * factor).backward()
        if fault == "grad_nan":
            model[2].bias.grad[0] = math.nan
            ref[2].bias.grad[0] = math.nan
        ref_steps = ref_opt.state[ref[0].weight]["step"].item() if ref_opt.state else 0
        took = opt.step()
        scaler.step(ref_opt)
        scaler.update()
        ref_took = ref_opt.state[ref[0].weight]["step"].item() > ref_steps
        assert took == ref_took, t
        assert took == (fault is None), t
        assert opt.loss_scale == scaler.get_scale(), t
        assert opt.get_loss_scale().item() == scaler.get_scale()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, **tol)
        opt.zero_grad()
        ref_opt.zero_grad()
        scales.append(opt.loss_scale)
        skips.append(not took)
    assert sum(skips) == len(_FAULTS)
    assert max(scales) > 2.0**10 and min(scales) < 2.0**10  # it both grew and backed off


def test_param_groups_match_torch_adamw_groups() -> None:
    """Per-group weight decay through a factory equals torch.optim.AdamW's param groups."""
    model = _mlp()
    ref = copy.deepcopy(model)
    x, y = _data()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    opt = MixedPrecisionOptimizer(
        [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
        lambda weight_decay=0.5: functopt.adamw(1e-2, weight_decay=weight_decay),
        loss_scale=None,
    )
    ref_opt = torch.optim.AdamW(
        [{"params": [p for n, p in ref.named_parameters() if n.endswith("weight")]},
         {"params": [p for n, p in ref.named_parameters() if n.endswith("bias")],
          "weight_decay": 0.0}],
        lr=1e-2, weight_decay=0.5,
    )
    for _ in range(10):
        opt.backward(_loss(model, x, y))
        _loss(ref, x, y).backward()
        assert opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    # Unnamed params are numbered over all groups, as torch.optim numbers them.
    assert set(_nested(opt)["inner_state"]["inner_states"]) == {"0", "1"}
    assert set(_nested(opt)["inner_state"]["inner_states"]["1"]["0"]["mu"]) == {"2", "3"}


def test_param_groups_equal_partition_by_hand_bitwise() -> None:
    model = _mlp(torch.bfloat16)
    x, y = _data(torch.bfloat16)
    named = dict(model.named_parameters())
    groups = [{"params": {n: p for n, p in named.items() if "weight" in n}, "lr": 1e-2},
              {"params": {n: p for n, p in named.items() if "bias" in n}, "lr": 1e-3}]
    opt = MixedPrecisionOptimizer(groups, lambda lr: functopt.sgd(lr, momentum=0.9))
    labels = {n: (0 if "weight" in n else 1) for n in named}
    by_hand = mixed_precision(
        functopt.partition({0: functopt.sgd(1e-2, momentum=0.9),
                            1: functopt.sgd(1e-3, momentum=0.9)}, labels),
        loss_scale=functopt.dynamic_loss_scale(),
    )
    params = {n: p.detach().clone() for n, p in named.items()}
    state = by_hand.init(params)
    for _ in range(3):
        opt.backward(_loss(model, x, y))
        grads = {n: p.grad for n, p in named.items()}
        params, state = by_hand.step(grads, state, params)
        assert opt.step()
        opt.zero_grad()
        for n, p in named.items():
            assert _same_bits(p, params[n]), n
    assert _same_nested(_nested(opt), _state_dict.to_nested("test", state))


# -- low precision: exact master weights ------------------------------------------------


@pytest.mark.parametrize("dtype", LOW)
def test_low_precision_model_trains_and_params_are_the_rounded_master(dtype) -> None:
    model = _mlp(dtype)
    x, y = _data(dtype)
    opt = MixedPrecisionOptimizer(model.named_parameters(), functopt.adamw(3e-2))
    opt.clip_grad_norm(model, 1.0)
    losses = []
    for _ in range(40):
        loss = _loss(model, x, y)
        losses.append(loss.item())
        opt.backward(loss)
        assert opt.step()
        opt.zero_grad()
        master = _nested(opt)["master"]
        assert set(master) == {n for n, _ in model.named_parameters()}
        for n, p in model.named_parameters():
            assert master[n].dtype == torch.float32
            assert _same_bits(p, master[n].to(dtype)), n
    assert losses[-1] < 0.5 * losses[0]


def test_float32_params_have_no_master_copy_and_mixed_models_work() -> None:
    model = _mlp()
    model[2].to(torch.bfloat16)
    model[0].weight.data = model[0].weight.data.half()
    opt = MixedPrecisionOptimizer(model.named_parameters(), functopt.sgd(0.1), loss_scale=None)
    assert set(_nested(opt)["master"]) == {"0.weight", "2.weight", "2.bias"}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    assert opt.step()
    for n, p in model.named_parameters():
        assert not torch.equal(p, before[n]), n
        if n in _nested(opt)["master"]:
            assert _same_bits(p, _nested(opt)["master"][n].to(p.dtype))


# -- bitwise equal to the functional step -------------------------------------------------


@st.composite
def _named_params_and_grad_steps(draw: st.DrawFn) -> tuple[dict[str, torch.Tensor], list[Any]]:
    tree = draw(fst.params(dtypes=(torch.float16, torch.bfloat16, torch.float32),
                           max_leaves=4))
    named = {
        path: leaf for path, leaf in _core.leaves_with_path(tree) if leaf is not None
    }
    steps = [
        draw(fst.gradients_like(named, kind=draw(st.sampled_from(["finite", "any"])),
                                allow_none=True))
        for _ in range(draw(st.integers(1, 3)))
    ]
    return named, steps


@given(case=_named_params_and_grad_steps(), clip=st.sampled_from([None, 0.5]))
def test_facade_equals_functional_step_bitwise(case, clip) -> None:
    named, steps = case
    params = {n: torch.nn.Parameter(p.clone()) for n, p in named.items()}
    opt = MixedPrecisionOptimizer(params, functopt.adamw(1e-2))
    opt.clip_grad_norm(None, clip)
    tx = mixed_precision(functopt.adamw(1e-2), loss_scale=functopt.dynamic_loss_scale(),
                         max_grad_norm=clip)
    ref_params = {n: p.clone() for n, p in named.items()}
    state = tx.init(ref_params)
    taken = 0
    for grads in steps:
        if all(g is None for g in grads.values()):
            continue
        for n, p in params.items():
            p.grad = None if grads[n] is None else grads[n].clone()
        ref_params, state = tx.step(grads, state, ref_params)
        took = opt.step()
        assert took == (not bool(state.metrics.found_inf))
        taken += took
        for n, p in params.items():
            assert _same_bits(p, ref_params[n]), n
        # the plain recipe runs as inject_hyperparams of itself: the same state inside, the
        # recipe's values injected (float64, as inject_hyperparams keeps Python numbers)
        plain, count, hyper = _plain_view(_nested(opt))
        assert _same_nested(plain, _state_dict.to_nested("test", state))
        assert count.item() == taken
        assert {k: v.item() for k, v in hyper.items()} == {
            "learning_rate": 1e-2, "b1": 0.9, "b2": 0.999, "eps": 1e-8, "eps_root": 0.0,
            "weight_decay": 1e-4}  # functopt.adamw's defaults (optax's)
        assert all(v.dtype == torch.float64 for v in hyper.values())
        assert _same_bits(opt.get_grad_norm(), state.metrics.grad_norm)
        assert _same_bits(opt.count_zeros(), state.metrics.num_zeros)


# -- checkpoints ----------------------------------------------------------------------------


def _train(model, opt, x, y, steps: range, faults: dict[int, float]) -> list[bool]:
    out = []
    for t in steps:
        opt.backward(_loss(model, x, y) * faults.get(t, 1.0))
        out.append(opt.step())
        opt.zero_grad()
    return out


def _groups(model):
    named = list(model.named_parameters())
    return [{"params": [(n, p) for n, p in named if "weight" in n]},
            {"params": [(n, p) for n, p in named if "bias" in n], "weight_decay": 0.0}]


def _factory(weight_decay: float = 0.1) -> functopt.GradientTransformation:
    return functopt.adamw(1e-2, weight_decay=weight_decay)


def test_restored_optimizer_continues_bitwise() -> None:
    x, y = _data(torch.bfloat16)
    faults = {2: math.inf, 9: math.inf}
    scale = functopt.dynamic_loss_scale(init_scale=2.0**8, growth_interval=2, hysteresis=2,
                                        min_scale=1.0)
    model = _mlp(torch.bfloat16)
    opt = MixedPrecisionOptimizer(_groups(model), _factory, loss_scale=scale)
    opt.clip_grad_norm(model, 0.5)
    _train(model, opt, x, y, range(6), faults)
    saved = _roundtrip({"model": model.state_dict(), "optim": opt.state_dict()})

    restored_model = _mlp(torch.bfloat16, seed=7)
    restored_model.load_state_dict(saved["model"])
    restored = MixedPrecisionOptimizer(_groups(restored_model), _factory, loss_scale=scale)
    restored.clip_grad_norm(restored_model, 0.5)
    restored.load_state_dict(saved["optim"])

    took = _train(model, opt, x, y, range(6, 14), faults)
    took_restored = _train(restored_model, restored, x, y, range(6, 14), faults)
    assert took == took_restored and not all(took)
    for p, q in zip(model.parameters(), restored_model.parameters(), strict=True):
        assert _same_bits(p, q)
    assert _same_nested(opt.state_dict(), restored.state_dict())
    assert opt.loss_scale == restored.loss_scale


def test_state_dict_is_torchs_layout_with_entries_keyed_by_state_paths() -> None:
    model = _mlp(torch.bfloat16)
    opt = MixedPrecisionOptimizer(model.named_parameters(), functopt.adamw(1e-3))
    sd = opt.state_dict()
    assert set(sd) == {"state", "param_groups"}
    names = [n for n, _ in model.named_parameters()]
    (group,) = sd["param_groups"]
    assert group["params"] == list(range(len(names))) and group["param_names"] == names
    assert set(sd["state"]) == set(range(len(names)))
    for pid, name in enumerate(names):
        entry = sd["state"][pid]
        # the recipe's state under its injected state (a plain recipe runs as
        # inject_hyperparams of itself): the injected count and values are shared leaves
        assert {"master", "inner_state.inner_state.0.mu", "inner_state.inner_state.0.nu",
                "inner_state.inner_state.0.count", "inner_state.count",
                "inner_state.hyperparams.learning_rate", "inner_state.hyperparams.b1",
                "loss_scale.scale", "loss_scale.growth_tracker", "key"} <= set(entry)
        assert entry["master"] is opt._state.master[name]
        inner = opt._state.inner_state
        assert entry["inner_state.inner_state.0.mu"] is inner.inner_state[0].mu[name]
        assert entry["inner_state.hyperparams.learning_rate"] is \
            inner.hyperparams["learning_rate"]  # shared by all
        assert entry["inner_state.count"] is inner.count
        assert entry["loss_scale.scale"] is opt._state.loss_scale.scale  # shared by all
    roundtrip = _roundtrip(sd)  # torch.load(weights_only=True) reads it
    assert _same_nested(roundtrip["state"], sd["state"])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_state_dict_round_trips_through_distributed_checkpoint(tmp_path) -> None:
    """DCP loads in place into a template: the state dict of a fresh optimizer."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    x, y = _data(torch.bfloat16)
    model = _mlp(torch.bfloat16)
    opt = MixedPrecisionOptimizer(model.named_parameters(), functopt.adamw(1e-2))
    _train(model, opt, x, y, range(3), {1: math.inf})
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=tmp_path)
    other = _mlp(torch.bfloat16, seed=4)
    other_opt = MixedPrecisionOptimizer(other.named_parameters(), functopt.adamw(1e-2))
    template = {"optim": other_opt.state_dict()}
    dcp.load(template, checkpoint_id=tmp_path)
    other_opt.load_state_dict(template["optim"])
    assert _same_nested(other_opt.state_dict(), opt.state_dict())
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        assert _same_bits(p, q)


def test_load_state_dict_sets_low_precision_params_from_the_master() -> None:
    model = _mlp(torch.bfloat16)
    opt = MixedPrecisionOptimizer(model.named_parameters(), functopt.sgd(0.1))
    sd = opt.state_dict()
    other = _mlp(torch.bfloat16, seed=3)
    opt2 = MixedPrecisionOptimizer(other.named_parameters(), functopt.sgd(0.1))
    opt2.load_state_dict(sd)
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        assert _same_bits(p, q)


def test_state_dicts_share_nothing_with_later_states() -> None:
    """A state dict taken before some steps keeps its values; a loaded dict can be changed
    in place afterwards (as torch.distributed.checkpoint.load does) without effect."""
    model = _mlp(torch.bfloat16)
    opt = MixedPrecisionOptimizer(model.named_parameters(), functopt.adamw(1e-2))
    x, y = _data(torch.bfloat16)
    _train(model, opt, x, y, range(2), {})
    sd = opt.state_dict()
    before = copy.deepcopy(sd)
    _train(model, opt, x, y, range(3), {})  # steps make new tensors; sd stays as it was
    assert _same_nested(sd, before)
    opt.load_state_dict(sd)
    sd["state"][0]["inner_state.inner_state.0.mu"].fill_(7.0)
    sd["state"][0]["inner_state.hyperparams.learning_rate"].fill_(7.0)
    sd["state"][0]["loss_scale.scale"].fill_(2.0)
    assert _same_nested(opt.state_dict(), before)


def test_reload_model_params_copies_the_params_into_the_master() -> None:
    model = _mlp(torch.bfloat16)
    opt = MixedPrecisionOptimizer(model.named_parameters(), functopt.adamw(1e-2))
    x, y = _data(torch.bfloat16)
    _train(model, opt, x, y, range(3), {})
    inner_before = copy.deepcopy(_nested(opt)["inner_state"])
    model.load_state_dict(_mlp(torch.bfloat16, seed=5).state_dict())
    stale = _nested(opt)["master"]["0.weight"]
    assert not torch.equal(stale.to(torch.bfloat16), model[0].weight)
    opt.reload_model_params()
    sd = _nested(opt)
    for n, p in model.named_parameters():
        assert _same_bits(sd["master"][n], p.detach().float())
    assert _same_nested(sd["inner_state"], inner_before)


def test_state_kept_by_a_transform_does_not_alias_the_params() -> None:
    """A transform may keep the params it was initialised with; step() writes params in
    place, so the facade must hold a copy."""

    def init(params):
        return {"anchor": params}

    def update(updates, state, params=None, **extra):
        return updates, state

    keep = functopt.GradientTransformation(init, update)
    w = torch.nn.Parameter(torch.ones(3))
    opt = MixedPrecisionOptimizer([("w", w)], functopt.chain(keep, functopt.sgd(1.0)),
                                  loss_scale=None)
    w.grad = torch.ones(3)
    with pytest.warns(functopt.fast.FastPathWarning, match="a transform without a spec"):
        opt.step()  # a hand-written transform: the pure path, and the step says so
    assert torch.equal(w, torch.zeros(3))
    assert torch.equal(_nested(opt)["inner_state"]["0"]["anchor"]["w"], torch.ones(3))


# -- the training-loop calls ------------------------------------------------------------------


def test_backward_scales_the_loss() -> None:
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = MixedPrecisionOptimizer([("w", w)], functopt.sgd(0.1))
    loss = (w * torch.tensor([3.0, 0.5])).sum()
    opt.backward(loss, retain_graph=True)
    assert torch.equal(w.grad, torch.tensor([3.0, 0.5]) * 65536)
    opt.zero_grad()
    opt.backward(loss)  # the retained graph is used again
    assert torch.equal(w.grad, torch.tensor([3.0, 0.5]) * 65536)


def test_float16_model_backs_off_until_its_gradients_fit() -> None:
    """The scaled float16 gradients overflow (65536 is not a float16; 3 * 32768 neither)
    until the scale has backed off to 16384, as with GradScaler."""
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float16))
    opt = MixedPrecisionOptimizer([("w", w)], functopt.sgd(0.25))
    taken = []
    for _ in range(3):
        opt.backward((w * torch.tensor([3.0, 0.5], dtype=torch.float16)).sum())
        taken.append(opt.step())
        opt.zero_grad()
    assert taken == [False, False, True] and opt.loss_scale == 16384.0
    assert torch.equal(w, torch.tensor([0.25, -2.125], dtype=torch.float16))


def test_zero_grad() -> None:
    w = torch.nn.Parameter(torch.ones(2))
    opt = MixedPrecisionOptimizer([w], functopt.sgd(0.1))
    w.grad = torch.ones(2)
    grad = w.grad
    opt.zero_grad(set_to_none=False)
    assert w.grad is grad and torch.equal(grad, torch.zeros(2))
    opt.zero_grad()
    assert w.grad is None


def test_params_without_grad_are_left_unchanged() -> None:
    model = _mlp(torch.bfloat16)
    opt = MixedPrecisionOptimizer(model.named_parameters(), functopt.adamw(1e-2))
    x, y = _data(torch.bfloat16)
    frozen = model[2].bias.detach().clone()
    before = copy.deepcopy(_nested(opt))
    opt.backward(_loss(model, x, y))
    model[2].bias.grad = None
    assert opt.step()
    after = _nested(opt)
    assert _same_bits(model[2].bias, frozen)
    assert _same_bits(after["master"]["2.bias"], before["master"]["2.bias"])
    for moment in ("mu", "nu"):
        now, then = after["inner_state"]["inner_state"], before["inner_state"]["inner_state"]
        assert _same_bits(now["0"][moment]["2.bias"], then["0"][moment]["2.bias"])
        assert not _same_bits(now["0"][moment]["0.weight"], then["0"][moment]["0.weight"])
    assert not _same_bits(model[0].weight, before["master"]["0.weight"].to(torch.bfloat16))


def test_clip_grad_norm_sets_the_norm_of_following_steps() -> None:
    w = torch.nn.Parameter(torch.zeros(2))
    opt = MixedPrecisionOptimizer([("w", w)], functopt.sgd(1.0), loss_scale=None)
    assert opt.clip_grad_norm(None, 1.0) is None
    w.grad = torch.tensor([3.0, 4.0])
    assert opt.step()
    assert opt.get_grad_norm().item() == 5.0  # before clipping
    torch.testing.assert_close(w.detach(), torch.tensor([-0.6, -0.8]))
    opt.clip_grad_norm(None, 0)  # off again
    assert opt.step()
    torch.testing.assert_close(w.detach(), torch.tensor([-3.6, -4.8]))
    opt.clip_grad_norm(None, 10.0)  # a bound above the norm changes nothing
    assert opt.step()
    torch.testing.assert_close(w.detach(), torch.tensor([-6.6, -8.8]))


def test_metrics_getters() -> None:
    w = torch.nn.Parameter(torch.zeros(4))
    opt = MixedPrecisionOptimizer({"w": w}, functopt.sgd(1.0), count_zeros=True)
    assert opt.get_grad_norm().item() == 0.0 and opt.count_zeros().item() == 0
    w.grad = torch.tensor([0.0, 3.0, 0.0, 4.0]) * 65536
    assert opt.step()
    norm, zeros, scale = opt.get_grad_norm(), opt.count_zeros(), opt.get_loss_scale()
    assert norm.shape == zeros.shape == scale.shape == ()
    assert norm.dtype == torch.float32 and zeros.dtype == torch.int64
    assert norm.item() == 5.0 and zeros.item() == 2
    assert scale.dtype == torch.float32 and scale.item() == opt.loss_scale == 65536.0
    assert isinstance(opt.loss_scale, float)
    w.grad = torch.tensor([math.inf, 0.0, 0.0, 0.0])
    assert not opt.step()
    assert not math.isfinite(opt.get_grad_norm().item())
    assert "1 params" in repr(opt) and "dynamic" in repr(opt)


@pytest.mark.parametrize("form", ["list", "named", "dict", "groups", "group_dict",
                                  "group_tensors", "param_names"])
def test_params_forms_and_names(form: str) -> None:
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    params: Any = {
        "list": [a, b],
        "named": iter([("a", a), ("b", b)]),
        "dict": {"a": a, "b": b},
        "groups": [{"params": [a]}, {"params": [b]}],
        "group_dict": {"params": {"a": a, "b": b}},
        "group_tensors": [{"params": a}, {"params": b}],
        "param_names": [{"params": [a, b], "param_names": ["a", "b"]}],
    }[form]
    opt = MixedPrecisionOptimizer(params, functopt.adam(0.1))
    expected = {"0", "1"} if form in ("list", "groups", "group_tensors") else {"a", "b"}
    inner = _nested(opt)["inner_state"]
    if form in ("groups", "group_tensors"):  # one injected state per group (its own lr)
        assert [set(inner["inner_states"][g]["inner_state"]["0"]["mu"]) for g in ("0", "1")] \
            == [{"0"}, {"1"}]
    else:
        assert set(inner["inner_state"]["0"]["mu"]) == expected
    a.grad, b.grad = torch.ones(2), torch.ones(3)
    assert opt.step()
    assert torch.all(a < 1) and torch.all(b < 1)


# -- errors -------------------------------------------------------------------------------------


def test_step_without_any_gradient_raises() -> None:
    model = _mlp()
    opt = MixedPrecisionOptimizer(model.named_parameters(), functopt.sgd(0.1))
    with pytest.raises(RuntimeError, match=r"none of the 4 params has a gradient .*'0\.weight'"):
        opt.step()


@pytest.mark.parametrize(
    ("dtype", "match"),
    [(torch.int64, r"param 'idx' is int64; only floating"),
     (torch.bool, r"param 'idx' is bool; only floating"),
     (torch.complex64, r"param 'idx' is complex64; only floating")],
)
def test_rejects_params_of_unsupported_dtype(dtype, match) -> None:
    w = torch.nn.Parameter(torch.ones(2))
    bad = torch.zeros(2, dtype=dtype)
    with pytest.raises(TypeError, match=match):
        MixedPrecisionOptimizer([("w", w), ("idx", bad)], functopt.sgd(0.1))


@pytest.mark.parametrize("master_dtype", [torch.float32, torch.float64])
def test_float64_params_are_updated_in_float64(master_dtype) -> None:
    w = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
    opt = MixedPrecisionOptimizer([w], functopt.sgd(1.0), master_dtype=master_dtype)
    assert "master" not in opt.state_dict()  # no copy: float64 is not narrower
    w.grad = torch.full((2,), 1e-12, dtype=torch.float64) * 65536
    assert opt.step() and torch.equal(w, torch.full((2,), 1 - 1e-12, dtype=torch.float64))


@pytest.mark.parametrize(
    ("params", "error", "match"),
    [
        (lambda w: [("w", w), ("frozen", torch.ones(2))], ValueError,
         r"param 'frozen' does not require grad"),
        (lambda w: [("w", w), ("derived", w * 2)], ValueError,
         r"param 'derived' is not a leaf"),
        (lambda w: [("w", w), ("again", w)], ValueError,
         r"same tensor appears twice, as 'w' and 'again'"),
        (lambda w: [{"params": [("w", w)]}, {"params": [("w", torch.nn.Parameter(w.detach()))]}],
         ValueError, r"the name 'w' is used by two params \(groups 0 and 1\)"),
        (lambda w: [], ValueError, r"empty list of params"),
        (lambda w: w, TypeError, r"single tensor of shape \(2,\)"),
        (lambda w: torch.nn.Linear(1, 1), TypeError, r"params is a Linear module"),
        (lambda w: 3, TypeError, r"params must be an iterable, got int"),
        (lambda w: [{"params": [w]}, w], TypeError, r"mixes group dicts with tensors"),
        (lambda w: [{"lr": 0.1}], ValueError, r"param group 0 has no 'params' key"),
        (lambda w: [("w", w), ("x", "not a tensor")], TypeError,
         r"param 'x' is a str, expected a torch.Tensor"),
        (lambda w: {"": w}, TypeError, r"parameter names must be non-empty strings"),
        (lambda w: [{"params": [w], "param_names": ["a", "b"]}], ValueError,
         r"param group 0 has 1 params but 2 param_names"),
    ],
)
def test_rejects_malformed_params(params, error, match) -> None:
    w = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(error, match=match):
        MixedPrecisionOptimizer(params(w), functopt.sgd(0.1))


def test_rejects_malformed_transform_and_options() -> None:
    w = torch.nn.Parameter(torch.ones(2))
    # a chain of the user's has no hyperparameters in the groups
    with pytest.raises(TypeError, match=r"param group 0 sets \['lr'\], but transform is a "
                                        r"GradientTransformation"):
        MixedPrecisionOptimizer([{"params": [w], "lr": 0.1}],
                                functopt.chain(functopt.scale_by_adam(), functopt.scale(-0.1)))
    # a recipe reads its hyperparameters from the groups, and nothing else
    with pytest.raises(ValueError, match=r"param_groups\[0\] sets 'momentum', but the "
                                         r"transform has no hyperparameter for it .* \(its groups "
                                         r"hold the transform's hyperparameters \['betas', 'eps', "
                                         r"'eps_root', 'lr'\],"):
        MixedPrecisionOptimizer([{"params": [w], "momentum": 0.9}], functopt.adam(0.1))
    with pytest.raises(TypeError, match=r"factory failed on the options of param group 0 "
                                        r"\(\['momentum'\]\)"):
        MixedPrecisionOptimizer([{"params": [w], "momentum": 0.9}], lambda lr=0.1:
                                functopt.sgd(lr))
    with pytest.raises(TypeError, match=r"factory returned a float for param group 0"):
        MixedPrecisionOptimizer([w], lambda: 0.1)
    with pytest.raises(TypeError, match=r"transform must be a functopt.GradientTransformation"):
        MixedPrecisionOptimizer([w], 0.1)
    with pytest.raises(TypeError, match=r"loss_scale must be a functopt.LossScale"):
        MixedPrecisionOptimizer([w], functopt.sgd(0.1), loss_scale=128.0)
    with pytest.raises(TypeError, match=r"master_dtype must be a floating torch.dtype"):
        MixedPrecisionOptimizer([w], functopt.sgd(0.1), master_dtype=torch.int32)


def test_rejects_bad_calls() -> None:
    w = torch.nn.Parameter(torch.ones(2))
    opt = MixedPrecisionOptimizer([w], functopt.sgd(0.1))
    with pytest.raises(TypeError, match=r"backward: loss must be a tensor, got float"):
        opt.backward(1.0)  # type: ignore[arg-type]
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match=r"clip_grad_norm: max_norm must be a finite "
                                             r"number >= 0"):
            opt.clip_grad_norm(None, bad)
    with pytest.raises(TypeError, match=r"max_norm must be a Python number or None, got "
                                        r"Tensor"):
        opt.clip_grad_norm(None, torch.tensor(1.0))  # type: ignore[arg-type]


def _opt_for(**shapes: tuple[int, ...]) -> MixedPrecisionOptimizer:
    params = {n: torch.nn.Parameter(torch.ones(s, dtype=torch.bfloat16))
              for n, s in shapes.items()}
    return MixedPrecisionOptimizer(params, functopt.adam(0.1))


def test_load_state_dict_rejects_other_names() -> None:
    sd = _opt_for(a=(2,), b=(3,)).state_dict()
    with pytest.raises(ValueError, match=r"names its params \['a', 'c'\], the state dict's "
                                         r"group \['a', 'b'\]: this group's \['c'\] have no "
                                         r"saved state and the saved \['b'\] no param here"):
        _opt_for(a=(2,), c=(3,)).load_state_dict(sd)


def test_load_state_dict_rejects_other_shapes() -> None:
    sd = _opt_for(a=(2,), b=(3,)).state_dict()
    with pytest.raises(ValueError, match=r"'master' of param 'b' has shape \(3,\), this "
                                         r"optimizer's state has \(4,\)"):
        _opt_for(a=(2,), b=(4,)).load_state_dict(sd)


def test_load_state_dict_rejects_a_float16_loss_scale() -> None:
    opt = _opt_for(a=(2,))
    sd = opt.state_dict()
    sd["state"][0]["loss_scale.scale"] = sd["state"][0]["loss_scale.scale"].half()
    with pytest.raises(TypeError, match=r"'loss_scale.scale' of param 'a' is float16, but "
                                        r"this optimizer keeps it in float32"):
        opt.load_state_dict(sd)
    sd["state"][0]["loss_scale.scale"] = 65536.0
    with pytest.raises(TypeError, match=r"the state of param 'a' has 'loss_scale.scale' = "
                                        r"float; expected a tensor"):
        opt.load_state_dict(sd)
    with pytest.raises(TypeError, match=r"expected a state dict .* got list"):
        opt.load_state_dict([])  # type: ignore[arg-type]
    assert opt.loss_scale == 65536.0  # a failed load leaves the optimizer as it was


def test_state_dict_rejects_non_tensor_state() -> None:
    counter = functopt.GradientTransformation(lambda p: {"steps": 0},
                                              lambda u, s, p=None, **kw: (u, s))
    opt = MixedPrecisionOptimizer([torch.nn.Parameter(torch.ones(1))],
                                  functopt.chain(counter, functopt.sgd(0.1)))
    with pytest.raises(TypeError, match=r"state leaf 'inner_state.0.steps' is a int"):
        opt.state_dict()


@pytest.mark.parametrize("fused", [True, False])
def test_zeros_are_counted_only_when_asked(fused: bool) -> None:
    """Zeros are counted with count_zeros=True only; by default, as with False (Megatron's
    default), count_zeros() is -1 and the step is otherwise the same (bitwise the masters
    of a counting optimizer)."""
    results = {}
    for count in (True, False, None):
        w = torch.nn.Parameter(torch.tensor([0.0, 1.0, -2.0, 0.0], dtype=torch.bfloat16))
        flags = {} if count is None else {"count_zeros": count}
        opt = MixedPrecisionOptimizer([("w", w)], functopt.adamw(0.1), loss_scale=None,
                                      fused=fused, **flags)
        # before the first step too: -1 where nothing is counted, 0 counted so far
        assert int(opt.count_zeros()) == (0 if count else -1)
        w.grad = torch.tensor([0.0, 0.5, 0.0, 0.0], dtype=torch.bfloat16)
        assert opt.step()
        results[count] = (int(opt.count_zeros()), _nested(opt)["master"]["w"].clone())
    assert results[True][0] == 3 and results[False][0] == results[None][0] == -1
    assert torch.equal(results[True][1], results[False][1])
    assert torch.equal(results[True][1], results[None][1])
