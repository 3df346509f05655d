"""Param groups that matter: ``lr_mult``/``wd_mult`` and ``frozen`` in both adapters.

Trajectories against ``torch.optim.AdamW`` are compared in float64 to 1e-10 (the two sides
compute the same maths in a different order); runs of functopt against functopt (a frozen
group against the same model without it) are compared bitwise.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import functopt
from functopt import MixedPrecisionOptimizer, Optimizer
from functopt.adapters import _state_dict

F64 = torch.float64
TOL = 1e-10
LR, WD = 1e-2, 0.1


def _params(n=4, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    shapes = [(3, 2), (3,), (2, 2), (1,)][:n]
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in shapes]


def _grads(params, step, scale=1.0):
    g = torch.Generator().manual_seed(100 + step)
    return [scale * torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]


def _set_grads(params, grads):
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()


def _clone(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def _close(a, b):
    for p, q in zip(a, b, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=TOL)


def _bitwise(a, b):
    return all(torch.equal(p.detach().view(torch.uint8), q.detach().view(torch.uint8))
               for p, q in zip(a, b, strict=True))


def _injected_adamw(lr=LR, wd=WD):
    return functopt.inject_hyperparams(functopt.adamw)(
        learning_rate=lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=wd)


def _adamw_factory(learning_rate=LR, weight_decay=WD):
    return functopt.adamw(learning_rate, b1=0.9, b2=0.999, eps=1e-8, weight_decay=weight_decay)


def _torch_adamw(groups):
    return torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WD)


MULTS = [(0.5, 2.0), (3.0, 0.0), (1.0, 1.0)]  # (lr_mult, wd_mult) of groups 0, 1, 2


def _groups(params, mults=MULTS):
    # params 0 and 1 in group 0, 2 in group 1, 3 in group 2
    split = [[params[0], params[1]], [params[2]], [params[3]]]
    return [{"params": ps, "lr_mult": lm, "wd_mult": wm}
            for ps, (lm, wm) in zip(split, mults, strict=True)]


def _torch_groups(params, mults=MULTS):
    split = [[params[0], params[1]], [params[2]], [params[3]]]
    return [{"params": ps, "lr": LR * lm, "weight_decay": WD * wm}
            for ps, (lm, wm) in zip(split, mults, strict=True)]


def _nbytes(tree):
    leaves, _ = functopt.tree._core.flatten(tree)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


# -- functopt.Optimizer: multipliers ---------------------------------------------------


def test_optimizer_multipliers_equal_torch_adamw_with_multiplied_groups():
    ours, ref = _params(), _params()
    opt = Optimizer(_groups(ours), _injected_adamw())
    ref_opt = _torch_adamw(_torch_groups(ref))
    for step in range(20):
        grads = _grads(ours, step)
        _set_grads(ours, grads)
        _set_grads(ref, grads)
        opt.step()
        ref_opt.step()
    _close(ours, ref)
    # The groups hold the products, the values their steps use; the multipliers stay as
    # given, as records.
    assert [g["lr"] for g in opt.param_groups] == [LR * lm for lm, _ in MULTS]
    assert [g["weight_decay"] for g in opt.param_groups] == [WD * wm for _, wm in MULTS]
    assert [(g["lr_mult"], g["wd_mult"]) for g in opt.param_groups] == MULTS


@pytest.mark.parametrize("adapter", ["optimizer", "facade"])
def test_a_checkpoint_of_format_2_loads_with_its_multipliers_folded(adapter):
    """Groups saved in format 2 held the lr / weight_decay their steps multiplied by
    lr_mult / wd_mult; they load holding the products, and the run continues as it would
    have (format 3 groups hold the products already)."""
    def build(params):
        if adapter == "optimizer":
            return Optimizer(_groups(params), _injected_adamw())
        return MixedPrecisionOptimizer(_groups(params), _adamw_factory, loss_scale=None)

    ours = _params()
    opt = build(ours)
    for step in range(3):
        _set_grads(ours, _grads(ours, step))
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    old = copy.deepcopy(saved)
    for group in old["param_groups"]:
        lr_mult, wd_mult = group.get("lr_mult", 1.0), group.get("wd_mult", 1.0)
        group["lr"] /= lr_mult
        group["weight_decay"] = group["weight_decay"] / wd_mult if wd_mult else WD
        group["functopt"]["format"] = 2
    results = []
    for given in (saved, old):
        params = [p.detach().clone().requires_grad_() for p in ours]
        again = build(params)
        again.load_state_dict(given)
        assert [g["lr"] for g in again.param_groups] == [g["lr"] for g in opt.param_groups]
        assert [g["weight_decay"] for g in again.param_groups] == [
            g["weight_decay"] for g in opt.param_groups]
        _set_grads(params, _grads(params, 3))
        again.step()
        results.append(params)
    _set_grads(ours, _grads(ours, 3))
    opt.step()
    for params in results:
        assert all(torch.equal(a, b) for a, b in zip(params, ours, strict=True))


def test_optimizer_step_lr_keeps_the_ratio():
    """StepLR scales each group's lr, which holds the product, from its own: the groups
    keep their ratio, as torch's groups of those lrs do."""
    ours, ref = _params(), _params()
    opt = Optimizer(_groups(ours), _injected_adamw())
    ref_opt = _torch_adamw(_torch_groups(ref))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    for step in range(9):
        grads = _grads(ours, step)
        _set_grads(ours, grads)
        _set_grads(ref, grads)
        opt.step()
        ref_opt.step()
        sched.step()
        ref_sched.step()
        for group, ref_group in zip(opt.param_groups, ref_opt.param_groups, strict=True):
            assert group["lr"] == pytest.approx(
                LR * group["lr_mult"] * 0.5 ** ((step + 1) // 2), rel=1e-12)
            assert ref_group["lr"] == pytest.approx(group["lr"], rel=1e-12)
    _close(ours, ref)


def test_optimizer_multiplier_edited_between_steps_is_refused_and_a_written_lr_is_used():
    ours, ref = _params(), _params()
    opt = Optimizer(_groups(ours), _injected_adamw())
    ref_opt = _torch_adamw(_torch_groups(ref))
    for step in range(6):
        if step == 3:
            opt.param_groups[1]["lr_mult"] = 0.25
            with pytest.raises(ValueError, match=r"param_groups\[1\] changed lr_mult / "
                                                 r"wd_mult to 0\.25 / 0\.0 .*Fix: write"):
                opt.step()
            opt.param_groups[1]["lr_mult"] = 3.0
            opt.param_groups[1]["lr"] = LR * 0.25
            ref_opt.param_groups[1]["lr"] = LR * 0.25
        grads = _grads(ours, step)
        _set_grads(ours, grads)
        _set_grads(ref, grads)
        opt.step()
        ref_opt.step()
    _close(ours, ref)


def test_optimizer_tensor_lr_keeps_its_graph_through_the_multiplier():
    p = torch.nn.Parameter(torch.ones(2, dtype=F64))
    lr = torch.tensor(0.1, dtype=F64, requires_grad=True)
    tx = functopt.inject_hyperparams(functopt.sgd)(learning_rate=0.1)
    opt = Optimizer([{"params": [p], "lr": lr, "lr_mult": 2.0}], tx)
    p.grad = torch.ones(2, dtype=F64)
    plan = opt._plan(0, opt.param_groups[0])
    state = functopt.tree.unflatten(plan.treespec, opt._gather(
        0, opt.param_groups[0], plan, functopt.adapters._param_groups.GroupFlags(2.0, 1.0, False)))
    used = state.hyperparams["learning_rate"]
    assert used.requires_grad and torch.equal(used.detach(), torch.tensor(0.2, dtype=F64))


# -- functopt.Optimizer: frozen groups --------------------------------------------------


def test_optimizer_frozen_group_has_no_state_is_unchanged_and_others_equal_a_run_without_it():
    ours, alone = _params(), _params()
    frozen_before = [p.detach().clone() for p in ours[2:]]
    opt = Optimizer([{"params": ours[:2]}, {"params": ours[2:], "frozen": True}],
                    _injected_adamw())
    ref = Optimizer([{"params": alone[:2]}], _injected_adamw())
    for step in range(5):
        grads = _grads(ours, step, scale=1e3)  # the frozen params have (large) grads too
        _set_grads(ours, grads)
        _set_grads(alone[:2], grads[:2])
        opt.step()
        ref.step()
    assert _bitwise(ours[2:], frozen_before)
    assert _bitwise(ours[:2], alone[:2])
    assert all(p not in opt.state for p in ours[2:])
    saved = opt.state_dict()
    # param ids 2 and 3 (the frozen ones) have empty entries (DCP's strict load wants one)
    assert sorted(saved["state"]) == [0, 1, 2, 3] and saved["state"][2] == saved["state"][3] == {}
    assert saved["param_groups"][1]["frozen"] is True
    total = sum(_nbytes(v) for v in opt.state.values())
    assert total == sum(_nbytes(v) for v in ref.state.values()) and total > 0


def test_optimizer_frozen_params_need_not_require_grad_and_state_dict_round_trips():
    ours = _params()
    ours[3].requires_grad_(False)
    opt = Optimizer([{"params": ours[:3]}, {"params": ours[3:], "frozen": True}],
                    _injected_adamw())
    _set_grads(ours[:3], _grads(ours[:3], 0))
    opt.step()
    saved = opt.state_dict()
    twin = _clone(ours)
    opt2 = Optimizer([{"params": twin[:3]}, {"params": twin[3:], "frozen": True}],
                     _injected_adamw())
    opt2.load_state_dict(saved)
    assert all(p not in opt2.state for p in twin[3:])
    for p, q in zip(ours[:3], twin[:3], strict=True):
        assert sorted(opt.state[p]) == sorted(opt2.state[q])


def test_optimizer_unfreezing_starts_the_group_from_init():
    ours, ref = _params(), _params()
    opt = Optimizer([{"params": ours[:2]}, {"params": ours[2:], "frozen": True}],
                    _injected_adamw())
    ref_opt = Optimizer([{"params": ref[:2]}, {"params": ref[2:]}], _injected_adamw())
    _set_grads(ours, _grads(ours, 0))
    opt.step()
    opt.param_groups[1]["frozen"] = False
    for step in range(1, 4):
        _set_grads(ours, _grads(ours, step))
        opt.step()
    # group 1 took 3 steps from init, like a fresh optimizer given steps 1..3
    for step in range(1, 4):
        _set_grads(ref, _grads(ref, step))
        ref_opt.step()
    assert _bitwise(ours[2:], ref[2:])
    assert opt.state[ours[2]]["count"].item() == 3


# -- functopt.Optimizer: errors ---------------------------------------------------------


@pytest.mark.parametrize(("key", "value", "error", "match"), [
    ("lr_mult", -1.0, ValueError, r"param_groups\[1\] sets lr_mult=-1.0; expected a finite"),
    ("wd_mult", math.inf, ValueError, r"param_groups\[1\] sets wd_mult=inf; expected a finite"),
    ("lr_mult", "2", TypeError, r"param_groups\[1\] sets lr_mult='2' \(str\); expected a Py"),
    ("wd_mult", True, TypeError, r"param_groups\[1\] sets wd_mult=True \(bool\)"),
    ("frozen", 1, TypeError, r"param_groups\[1\] sets frozen=1 \(int\); expected True or"),
])
def test_optimizer_bad_group_flags_name_the_group(key, value, error, match):
    ps = _params()
    with pytest.raises(error, match=match):
        Optimizer([{"params": ps[:2]}, {"params": ps[2:], key: value}], _injected_adamw())


def test_optimizer_multiplier_without_injected_hyperparameter_is_an_error():
    ps = _params()
    tx = functopt.inject_hyperparams(functopt.adam)(learning_rate=LR)
    opaque = functopt.chain(functopt.scale_by_adam(), functopt.scale(-LR))  # no recipe record
    with pytest.raises(ValueError, match=r"param_groups\[0\] sets wd_mult=0.5, which multiplies "
                                         r"the injected 'weight_decay', but the transform does"):
        Optimizer([{"params": ps, "wd_mult": 0.5}], tx)
    with pytest.raises(ValueError, match=r"sets lr_mult=2.0, which multiplies the injected "
                                         r"'learning_rate'"):
        Optimizer([{"params": ps, "lr_mult": 2.0}], opaque)
    # a multiplier of 1 asks for nothing; a plain recipe exposes its learning rate
    Optimizer([{"params": ps, "lr_mult": 1.0}], opaque)
    Optimizer([{"params": ps, "lr_mult": 2.0}], functopt.adam(LR))


def test_optimizer_hyperparameter_named_like_a_flag_is_an_error():
    def odd(learning_rate, lr_mult):
        return functopt.scale(-learning_rate * lr_mult)

    tx = functopt.inject_hyperparams(odd)(learning_rate=0.1, lr_mult=2.0)
    with pytest.raises(ValueError, match=r"injects a hyperparameter named 'lr_mult', which "
                                         r"clashes with the param group key"):
        Optimizer(_params(), tx)


def test_optimizer_loading_state_into_a_frozen_group_is_an_error():
    ps = _params()
    opt = Optimizer([{"params": ps[:2]}, {"params": ps[2:]}], _injected_adamw())
    _set_grads(ps, _grads(ps, 0))
    opt.step()
    saved = opt.state_dict()
    saved["param_groups"][1]["frozen"] = True
    twin = _clone(ps)
    opt2 = Optimizer([{"params": twin[:2]}, {"params": twin[2:]}], _injected_adamw())
    with pytest.raises(ValueError, match=r"param_groups\[1\] is frozen, but the state dict "
                                         r"holds optimizer state"):
        opt2.load_state_dict(saved)


# -- MixedPrecisionOptimizer: multipliers -----------------------------------------------


def test_mpo_multipliers_equal_torch_adamw_with_multiplied_groups():
    ours, ref = _params(), _params()
    opt = MixedPrecisionOptimizer(_groups(ours), _adamw_factory, loss_scale=None)
    ref_opt = _torch_adamw(_torch_groups(ref))
    for step in range(20):
        grads = _grads(ours, step)
        _set_grads(ours, grads)
        _set_grads(ref, grads)
        assert opt.step()
        ref_opt.step()
    _close(ours, ref)


def test_mpo_multipliers_scale_the_groups_own_options_and_schedules():
    ours, ref = _params(), _params()
    def schedule(count):  # count: a 0-d int32 tensor; float64 keeps the 1e-10 comparison
        return LR * torch.tensor(0.5, dtype=F64) ** count
    groups = [{"params": ours[:2], "learning_rate": 0.02, "lr_mult": 0.5, "wd_mult": 3.0},
              {"params": ours[2:], "learning_rate": schedule, "lr_mult": 4.0}]
    opt = MixedPrecisionOptimizer(groups, _adamw_factory, loss_scale=None)
    ref_opt = _torch_adamw([{"params": ref[:2], "lr": 0.02 * 0.5, "weight_decay": WD * 3.0},
                            {"params": ref[2:], "lr": LR * 4.0}])
    sched = torch.optim.lr_scheduler.ExponentialLR(ref_opt, gamma=0.5)
    for step in range(6):
        grads = _grads(ours, step)
        _set_grads(ours, grads)
        _set_grads(ref, grads)
        assert opt.step()
        ref_opt.step()
        # only group 1 decays in ours; undo the decay of group 0 in the reference
        sched.step()
        ref_opt.param_groups[0]["lr"] = 0.02 * 0.5
    _close(ours, ref)


# -- MixedPrecisionOptimizer: frozen groups, one norm, one skip ---------------------------


def _mpo(params, frozen_split=2, clip=None):
    opt = MixedPrecisionOptimizer(
        [{"params": [(f"a{i}", p) for i, p in enumerate(params[:frozen_split])]},
         {"params": [(f"f{i}", p) for i, p in enumerate(params[frozen_split:])],
          "frozen": True}],
        _adamw_factory, loss_scale=None)
    if clip is not None:
        opt.clip_grad_norm(None, clip)
    return opt


@pytest.mark.parametrize("dtype", [F64, torch.bfloat16])
def test_mpo_frozen_group_has_no_state_is_unchanged_and_others_equal_a_run_without_it(dtype):
    ours, alone = _params(dtype=dtype), _params(dtype=dtype)
    frozen_before = [p.detach().clone() for p in ours[2:]]
    opt = _mpo(ours, clip=0.5)
    ref = MixedPrecisionOptimizer([(f"a{i}", p) for i, p in enumerate(alone[:2])],
                                  _adamw_factory, loss_scale=None)
    ref.clip_grad_norm(None, 0.5)
    for step in range(5):
        grads = _grads(ours, step, scale=10.0)
        grads[3] = torch.full_like(grads[3], math.inf)  # a frozen grad overflows: no skip
        _set_grads(ours, grads)
        _set_grads(alone[:2], grads[:2])
        assert opt.step()
        assert ref.step()
        # the frozen grads are not in the norm
        assert torch.equal(opt.get_grad_norm(), ref.get_grad_norm())
    assert _bitwise(ours[2:], frozen_before)
    assert _bitwise(ours[:2], alone[:2])
    ours_sd, ref_sd = opt.state_dict(), ref.state_dict()
    assert "f0" not in str(list(_flat_keys(ours_sd)))
    assert sorted(_flat_keys(ours_sd)) == sorted(_flat_keys(ref_sd))
    assert _nbytes(ours_sd) == _nbytes(ref_sd) > 0
    opt.zero_grad()
    assert all(p.grad is None for p in ours)


def _flat_keys(nested, prefix=""):
    for k, v in nested.items():
        if isinstance(v, dict):
            yield from _flat_keys(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}"


def test_mpo_frozen_params_need_not_require_grad():
    ps = _params()
    ps[3].requires_grad_(False)
    opt = _mpo(ps, frozen_split=3)
    _set_grads(ps[:3], _grads(ps[:3], 0))
    assert opt.step()


def test_mpo_an_inf_in_one_group_skips_every_group():
    ps = _params()
    opt = MixedPrecisionOptimizer(_groups(ps), _adamw_factory)  # dynamic loss scale
    _set_grads(ps, _grads(ps, 0))
    assert opt.step()
    before = [p.detach().clone() for p in ps]
    state_before = copy.deepcopy(_state_dict.to_nested("t", opt._state)["inner_state"])
    grads = _grads(ps, 1)
    grads[2] = torch.full_like(grads[2], math.nan)  # group 1 only
    _set_grads(ps, grads)
    assert not opt.step()
    assert _bitwise(ps, before)
    after = _state_dict.to_nested("t", opt._state)["inner_state"]
    assert all(torch.equal(a, b) for a, b in zip(_leaves(state_before), _leaves(after),
                                                 strict=True))
    assert len(_leaves(after)) == 11  # a count per group (3), mu and nu of 4 params
    assert not torch.isfinite(opt.get_grad_norm())


def _leaves(nested):
    return [v for _, v in sorted(_flat_items(nested))]


def _flat_items(nested, prefix=""):
    for k, v in nested.items():
        if isinstance(v, dict):
            yield from _flat_items(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def test_mpo_clipping_norm_covers_every_unfrozen_group():
    """One global norm over all groups, then per-group AdamW (a float64 reference)."""
    ours, ref = _params(), _params()
    opt = MixedPrecisionOptimizer(_groups(ours), _adamw_factory, loss_scale=None)
    max_norm = 0.3
    opt.clip_grad_norm(None, max_norm)
    ref_opt = _torch_adamw(_torch_groups(ref))
    for step in range(10):
        grads = _grads(ours, step)
        _set_grads(ours, grads)
        norm = torch.sqrt(sum((g * g).sum() for g in grads))
        factor = max_norm / norm if norm > max_norm else 1.0
        _set_grads(ref, [g * factor for g in grads])
        assert opt.step()
        ref_opt.step()
        torch.testing.assert_close(opt.get_grad_norm().double(), norm, rtol=1e-6, atol=0)
    _close(ours, ref)


# -- MixedPrecisionOptimizer: errors ------------------------------------------------------


def test_mpo_multiplier_with_a_fixed_transform_is_an_error():
    ps = _params()
    with pytest.raises(TypeError, match=r"param group 1 sets \['lr_mult'\], but transform is a "
                                        r"GradientTransformation"):
        MixedPrecisionOptimizer([{"params": ps[:2]}, {"params": ps[2:], "lr_mult": 2.0}],
                                functopt.chain(functopt.scale_by_adam(), functopt.scale(-LR)),
                                loss_scale=None)
    # (a plain recipe injects its learning rate, which the multiplier scales: see
    # tests/test_mixed_precision_optimizer_lifted.py)
    MixedPrecisionOptimizer([{"params": ps[:2]}, {"params": ps[2:], "lr_mult": 2.0}],
                            functopt.adamw(LR), loss_scale=None)
    # frozen and multipliers of 1 need no factory
    MixedPrecisionOptimizer([{"params": ps[:2], "lr_mult": 1.0}, {"params": ps[2:],
                                                                  "frozen": True}],
                            functopt.adamw(LR), loss_scale=None)


def test_mpo_multiplier_needs_a_base_value():
    ps = _params()
    with pytest.raises(TypeError, match=r"param group 0 sets wd_mult=2.0, which multiplies the "
                                        r"factory's 'weight_decay', but the group does not set"):
        MixedPrecisionOptimizer([{"params": ps, "wd_mult": 2.0}],
                                lambda learning_rate=LR: functopt.adam(learning_rate),
                                loss_scale=None)
    with pytest.raises(TypeError, match=r"param group 0 sets lr_mult=2.0, but its "
                                        r"'learning_rate' is str 'x'"):
        MixedPrecisionOptimizer([{"params": ps, "lr_mult": 2.0, "learning_rate": "x"}],
                                _adamw_factory, loss_scale=None)


@pytest.mark.parametrize(("key", "value", "error", "match"), [
    ("lr_mult", -0.5, ValueError, r"param_groups\[1\] sets lr_mult=-0.5; expected a finite"),
    ("wd_mult", None, TypeError, r"param_groups\[1\] sets wd_mult=None \(NoneType\)"),
    ("frozen", "yes", TypeError, r"param_groups\[1\] sets frozen='yes' \(str\)"),
])
def test_mpo_bad_group_flags_name_the_group(key, value, error, match):
    ps = _params()
    with pytest.raises(error, match=match):
        MixedPrecisionOptimizer([{"params": ps[:2]}, {"params": ps[2:], key: value}],
                                _adamw_factory, loss_scale=None)


def test_mpo_all_groups_frozen_is_an_error():
    with pytest.raises(ValueError, match=r"every param group is frozen"):
        MixedPrecisionOptimizer([{"params": _params(), "frozen": True}], _adamw_factory)


def test_mpo_param_without_grad_outside_a_frozen_group_suggests_frozen():
    ps = _params()
    ps[0].requires_grad_(False)
    with pytest.raises(ValueError, match=r"does not require grad.*frozen=True"):
        MixedPrecisionOptimizer(ps, _adamw_factory)
