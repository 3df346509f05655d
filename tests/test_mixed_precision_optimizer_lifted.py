"""MixedPrecisionOptimizer with a plain recipe: its hyperparameters in ``param_groups``.

``MixedPrecisionOptimizer(model, functopt.adamw(1e-3))`` runs the recipe as
``inject_hyperparams`` of itself (as ``functopt.Optimizer`` does), so the groups hold
``lr``, ``betas``, ... under torch's names and torch's schedulers drive them. References:
``torch.optim.AdamW`` under the same scheduler (float64), the functional
``mixed_precision(inject_hyperparams(adamw))`` step with the scheduler's values written into
its state (bitwise), and, for checkpoints saved before the lift, the plain functional step
``mixed_precision(adamw)`` the facade ran then (its state is what those checkpoints hold).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch

import functopt
from functopt import MixedPrecisionOptimizer
from functopt.adapters import _state_dict
from functopt.precision import mixed_precision, scale_loss
from functopt.precision.loss_scale import _rule_vector


def _mlp(dtype: torch.dtype, seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(),
                               torch.nn.Linear(4, 1)).to(dtype)


def _x(t: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.linspace(-1, 1, 12).reshape(4, 3) * (1 + t % 3)).to(dtype)


def _loss(model: torch.nn.Module, t: int, dtype: torch.dtype) -> torch.Tensor:
    return model(_x(t, dtype)).float().pow(2).mean()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _same_tree(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            _same_tree(a[k], b[k]) for k in a)
    return isinstance(b, torch.Tensor) and _same(a, b)


def test_a_plain_recipe_exposes_its_hyperparameters_under_torchs_names() -> None:
    model = _mlp(torch.bfloat16)
    opt = MixedPrecisionOptimizer(model.parameters(), functopt.adamw(1e-3, weight_decay=0.1))
    (group,) = opt.param_groups
    assert type(group) is dict
    assert {k: v for k, v in group.items() if k not in ("params", "param_names")} == {
        "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "eps_root": 0.0, "weight_decay": 0.1}
    # the same keys functopt.Optimizer's groups hold for the recipe (one table for both)
    for recipe in (functopt.adamw(1e-3), functopt.sgd(0.1, momentum=0.9),
                   functopt.rmsprop(1e-2)):
        facade = MixedPrecisionOptimizer(_mlp(torch.bfloat16).parameters(), recipe)
        torch_like = functopt.Optimizer(_mlp(torch.float32).parameters(), recipe)
        assert {k: v for k, v in facade.param_groups[0].items() if k != "param_names"
                and k != "params"} == {k: v for k, v in torch_like.param_groups[0].items()
                                       if k != "params"}
    assert "alpha" in MixedPrecisionOptimizer(
        _mlp(torch.bfloat16).parameters(), functopt.rmsprop(1e-2)).param_groups[0]


@pytest.mark.parametrize("scheduler", ["step", "lambda"])
def test_a_torch_scheduler_drives_a_plain_recipe_as_it_drives_torchs_adamw(
        scheduler: str) -> None:
    """float64 params (no master copy): the facade's AdamW and torch.optim.AdamW under the
    same scheduler, two groups (the second with its own lr and no weight decay). They differ
    by the rounding of the decoupled decay only (functopt: -lr * (adam + wd * p); torch:
    p * (1 - lr * wd), then the Adam step); a scheduler whose values were ignored would be
    off by orders of magnitude more (checked against the unscheduled run)."""
    dtype = torch.float64

    def groups(model: torch.nn.Module) -> list[dict[str, Any]]:
        return [{"params": [model[0].weight, model[2].weight]},
                {"params": [model[0].bias, model[2].bias], "lr": 0.05, "weight_decay": 0.0}]

    def make(opt: torch.optim.Optimizer) -> Any:
        if scheduler == "step":
            return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)
        return torch.optim.lr_scheduler.LambdaLR(opt, [lambda t: 1 / (1 + t),
                                                       lambda t: 0.5 ** t])

    model, ref, fixed = _mlp(dtype), _mlp(dtype), _mlp(dtype)
    opt = MixedPrecisionOptimizer(groups(model), functopt.adamw(0.02, weight_decay=0.1),
                                  loss_scale=None)
    ref_opt = torch.optim.AdamW(groups(ref), lr=0.02, weight_decay=0.1)
    fixed_opt = MixedPrecisionOptimizer(groups(fixed), functopt.adamw(0.02, weight_decay=0.1),
                                        loss_scale=None)
    sched, ref_sched = make(opt), make(ref_opt)
    for t in range(6):
        for m, o in ((model, opt), (ref, ref_opt), (fixed, fixed_opt)):
            _loss(m, t, dtype).backward()
            o.step()
            o.zero_grad()
        sched.step()
        ref_sched.step()
        assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]
    worst = max((p - q).abs().max().item()
                for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    off = max((p - q).abs().max().item()
              for p, q in zip(fixed.parameters(), ref.parameters(), strict=True))
    assert worst < 1e-14 and off > 1e-3, (worst, off)


def test_scheduled_lr_is_bitwise_the_functional_injected_step() -> None:
    """bfloat16 params with master copies, a dynamic loss scale that skips a step: the facade
    under StepLR is bitwise ``mixed_precision(inject_hyperparams(adamw))`` whose injected
    learning rate is set to the scheduler's value before each step."""
    dtype = torch.bfloat16
    model = _mlp(dtype)
    scale = functopt.dynamic_loss_scale(init_scale=2.0**8, growth_interval=2)
    opt = MixedPrecisionOptimizer(model.named_parameters(),
                                  functopt.adamw(0.02, weight_decay=0.1), loss_scale=scale)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    tx = mixed_precision(functopt.inject_hyperparams(functopt.adamw)(
        learning_rate=0.02, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, weight_decay=0.1),
        loss_scale=scale)
    ref_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = tx.init(ref_params)
    ref_model = copy.deepcopy(model)
    lr = 0.02
    for t in range(7):
        fault = math.inf if t == 3 else 1.0
        opt.backward(_loss(model, t, dtype) * fault)
        took = opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for n, p in ref_model.named_parameters():
                p.copy_(ref_params[n])
        ref_model.zero_grad()
        (scale_loss(_loss(ref_model, t, dtype) * fault, state)).backward()
        grads = {n: p.grad for n, p in ref_model.named_parameters()}
        hyper = dict(state.inner_state.hyperparams)
        hyper["learning_rate"] = torch.tensor(lr, dtype=torch.float64)
        state = state._replace(inner_state=state.inner_state._replace(hyperparams=hyper))
        ref_params, state = tx.step(grads, state, ref_params)
        assert took == (t != 3)
        for n, p in model.named_parameters():
            assert _same(p, ref_params[n]), (t, n)
        sched.step()
        lr = sched.get_last_lr()[0]
    assert opt._state.inner_state.hyperparams["learning_rate"].item() == 0.02 * 0.5 ** 3
    assert _same_tree(_state_dict.to_nested("a", opt._state),
                      _state_dict.to_nested("b", state))


def test_a_group_value_is_read_and_a_key_no_step_reads_raises() -> None:
    model = _mlp(torch.bfloat16)
    opt = MixedPrecisionOptimizer(model.parameters(), functopt.adamw(1e-2), loss_scale=None)
    opt.param_groups[0]["lr"] = 0.0  # read, not ignored: lr 0 leaves AdamW's params as they are
    before = [p.detach().clone() for p in model.parameters()]
    _loss(model, 0, torch.bfloat16).backward()
    assert opt.step()
    assert all(_same(p, q) for p, q in zip(model.parameters(), before, strict=True))
    opt.param_groups[0]["momentum"] = 0.9  # AdamW has no momentum: never ignored
    with pytest.raises(ValueError, match=r"param_groups\[0\] sets 'momentum', but the "
                                         r"transform has no hyperparameter for it .* \(its groups "
                                         r"hold the transform's hyperparameters \['betas', 'eps', "
                                         r"'eps_root', 'lr', 'weight_decay'\],"):
        opt.step()
    del opt.param_groups[0]["momentum"]
    opt.param_groups[0]["betas"] = 0.9
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['betas'\] must be a 2-tuple "
                                         r"\(b1, b2\), got 0.9"):
        opt.step()
    with pytest.raises(ValueError, match=r"param_groups\[0\] sets 'dampening', but the "
                                         r"transform has no hyperparameter for it"):
        MixedPrecisionOptimizer([{"params": model.parameters(), "dampening": 0.1}],
                                functopt.sgd(0.1, momentum=0.9))


def test_lr_mult_multiplies_a_plain_recipes_lr() -> None:
    """A group with lr_mult=4 holds four times the recipe's lr, and steps as a group of
    that lr (bitwise: 0.25 * 4 and 1.0 are the same float)."""
    a, b = _mlp(torch.bfloat16), _mlp(torch.bfloat16)
    opt_a = MixedPrecisionOptimizer([{"params": a.parameters(), "lr_mult": 4.0}],
                                    functopt.sgd(0.25), loss_scale=None)
    opt_b = MixedPrecisionOptimizer(b.parameters(), functopt.sgd(1.0), loss_scale=None)
    for m, o in ((a, opt_a), (b, opt_b)):
        for t in range(3):
            _loss(m, t, torch.bfloat16).backward()
            o.step()
            o.zero_grad()
    assert opt_a.param_groups[0]["lr"] == 1.0 and opt_a.param_groups[0]["lr_mult"] == 4.0
    assert all(_same(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


# -- checkpoints saved before the lift ---------------------------------------------------


def _groups(model: torch.nn.Module, grouped: bool) -> Any:
    named = list(model.named_parameters())
    if not grouped:
        return named
    return [{"params": [(n, p) for n, p in named if n.endswith("weight")]},
            {"params": [(n, p) for n, p in named if n.endswith("bias")]}]


_SCALE = functopt.dynamic_loss_scale(init_scale=2.0**8, growth_interval=2)
_FAULTS = {1: math.inf, 4: math.inf}


def _old_checkpoint(recipe: functopt.GradientTransformation, grouped: bool, steps: int,
                    nested: bool) -> tuple[dict[str, Any], torch.nn.Module]:
    """What the facade saved for a plain recipe before the lift: the state of the plain
    functional step ``mixed_precision(recipe)`` (which the facade then held), in the format
    of that time (format 2: each param's entry by state path, each group's configuration;
    nested: ``to_nested`` of the state with the rule and the group values)."""
    model = _mlp(torch.bfloat16)
    tx = mixed_precision(recipe, loss_scale=_SCALE)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = tx.init(params)
    for t in range(steps):
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(params[n])
        model.zero_grad()
        scale_loss(_loss(model, t, torch.bfloat16) * _FAULTS.get(t, 1.0),
                            state).backward()
        params, state = tx.step({n: p.grad for n, p in model.named_parameters()}, state,
                                params)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(params[n])
    groups = _groups(model, grouped)
    group_names = [[n for n, _ in g["params"]] for g in groups] if grouped else \
        [[n for n, _ in groups]]
    if nested:
        old = _state_dict.to_nested("old", state)
        old["loss_scale_rule"] = _rule_vector(_SCALE)
        old["param_groups"] = [{} for _ in group_names]  # a plain recipe's groups: no keys
        return copy.deepcopy(old), model
    names = [n for names in group_names for n in names]
    entries = _state_dict.Layout("old", state, names).entries(state)
    rule = [None if math.isnan(v) else v for v in _rule_vector(_SCALE).tolist()]
    config = {"format": 2, "transform": _state_dict.recipe_signature(recipe, {}),
              "loss_scale_rule": rule, "master_dtype": "float32"}
    sd: dict[str, Any] = {"state": {}, "param_groups": []}
    start = 0
    for group in group_names:
        ids = list(range(start, start + len(group)))
        start += len(group)
        sd["state"].update({i: dict(entries[n]) for i, n in zip(ids, group, strict=True)})
        sd["param_groups"].append({"params": ids, "param_names": group, "functopt": config})
    return copy.deepcopy(sd), model


def _uninterrupted(recipe: functopt.GradientTransformation, grouped: bool,
                   steps: range) -> tuple[torch.nn.Module, MixedPrecisionOptimizer]:
    model = _mlp(torch.bfloat16)
    opt = MixedPrecisionOptimizer(_groups(model, grouped), recipe, loss_scale=_SCALE)
    _train(model, opt, steps)
    return model, opt


def _train(model: torch.nn.Module, opt: MixedPrecisionOptimizer, steps: range) -> list[bool]:
    took = []
    for t in steps:
        opt.backward(_loss(model, t, torch.bfloat16) * _FAULTS.get(t, 1.0))
        took.append(opt.step())
        opt.zero_grad()
    return took


@pytest.mark.parametrize("grouped", [False, True], ids=["one-group", "two-groups"])
@pytest.mark.parametrize("nested", [False, True], ids=["format-2", "nested"])
def test_a_checkpoint_saved_before_the_lift_loads_bitwise(grouped: bool, nested: bool) -> None:
    """Saved after 5 steps (2 skipped) of the plain step; loaded into a facade over a model
    restored from it; 3 more steps equal an uninterrupted facade run of 8 steps, params and
    every state leaf bitwise (the injected count is the updates taken: 3 + 3)."""
    recipe = functopt.adamw(0.02, weight_decay=0.1)
    saved, saved_model = _old_checkpoint(recipe, grouped, 5, nested)
    model = _mlp(torch.bfloat16, seed=9)
    model.load_state_dict(saved_model.state_dict())
    opt = MixedPrecisionOptimizer(_groups(model, grouped), recipe, loss_scale=_SCALE)
    opt.load_state_dict(saved)
    ref_model, ref_opt = _uninterrupted(recipe, grouped, range(5))
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert _same(p, q)
    assert _same_tree(_state_dict.to_nested("a", opt._state),
                      _state_dict.to_nested("b", ref_opt._state))
    assert _train(model, opt, range(5, 8)) == _train(ref_model, ref_opt, range(5, 8))
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert _same(p, q)
    assert _same_tree(_state_dict.to_nested("a", opt._state),
                      _state_dict.to_nested("b", ref_opt._state))
    counts = ([opt._state.inner_state.inner_states[g].count for g in (0, 1)] if grouped
              else [opt._state.inner_state.count])
    assert [c.item() for c in counts] == [6] * len(counts)
    # and the groups are driven again: a scheduler's lr reaches the loaded state
    opt.param_groups[-1]["lr"] = 0.5
    _train(model, opt, range(8, 9))
    found = opt._state.inner_state.inner_states[1] if grouped else opt._state.inner_state
    assert found.hyperparams["learning_rate"].item() == 0.5


def test_a_stateless_recipe_of_before_the_lift_loads() -> None:
    """sgd without momentum had no inner state at all; the lifted one holds its count and
    learning rate."""
    recipe = functopt.sgd(0.1)
    saved, saved_model = _old_checkpoint(recipe, False, 3, False)
    model = _mlp(torch.bfloat16, seed=9)
    model.load_state_dict(saved_model.state_dict())
    opt = MixedPrecisionOptimizer(model.named_parameters(), recipe, loss_scale=_SCALE)
    opt.load_state_dict(saved)
    ref_model, ref_opt = _uninterrupted(recipe, False, range(3))
    assert _same_tree(_state_dict.to_nested("a", opt._state),
                      _state_dict.to_nested("b", ref_opt._state))
    _train(model, opt, range(3, 5))
    _train(ref_model, ref_opt, range(3, 5))
    assert all(_same(p, q) for p, q in zip(model.parameters(), ref_model.parameters(),
                                            strict=True))


def test_a_checkpoint_of_before_the_lift_of_another_recipe_raises() -> None:
    saved, _ = _old_checkpoint(functopt.adamw(0.02), False, 2, False)
    opt = MixedPrecisionOptimizer(_mlp(torch.bfloat16).named_parameters(), functopt.adam(0.02),
                                  loss_scale=_SCALE)
    with pytest.raises(ValueError, match=r"saved with transform 'adamw\(.*this optimizer has "
                                         r"'adam\("):
        opt.load_state_dict(saved)
    # an entry of the old layout that has no place in the recipe's state is named
    opt = MixedPrecisionOptimizer(_mlp(torch.bfloat16).named_parameters(), functopt.adamw(0.02),
                                  loss_scale=_SCALE)
    saved["state"][0]["inner_state.5.extra"] = torch.zeros(())
    with pytest.raises(ValueError, match=r"the state of param '0.weight' has unexpected keys "
                                         r"\['inner_state.5.extra'\]"):
        opt.load_state_dict(saved)
