"""functopt.Optimizer over a plain recipe (issue 10 item 2): its hyperparameters in
``param_groups`` under torch's names, read at every step, checked on every path.

References are torch.optim's optimizers driven the same way (float64, to 1e-12).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

import functopt
from functopt import Optimizer
from functopt.adapters import _param_groups

F64 = torch.float64
LR_SCHED = torch.optim.lr_scheduler


def _model(dtype=F64, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(),
                               torch.nn.Linear(4, 2)).to(dtype)


def _batch(dtype=F64):
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 3, generator=g, dtype=dtype), torch.randn(8, 2, generator=g,
                                                                    dtype=dtype)


def _train(model, opt, sched=None, steps=6):
    x, y = _batch(next(model.parameters()).dtype)
    for _ in range(steps):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        if sched is not None:
            sched.step()


def _max_diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(),
                                                          strict=True))


def test_plain_recipes_expose_their_hyperparameters_under_torchs_names():
    opt = Optimizer(_model().parameters(), functopt.adamw(1e-3, weight_decay=1e-2))
    group = opt.param_groups[0]
    assert type(group) is dict  # a plain dict: torch.compile and deepcopy take it as such
    assert {k: v for k, v in group.items() if k != "params"} == {
        "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "eps_root": 0.0,
        "weight_decay": 1e-2}
    sgd = Optimizer(_model().parameters(), functopt.sgd(0.1, momentum=0.9))
    assert (sgd.param_groups[0]["lr"], sgd.param_groups[0]["momentum"]) == (0.1, 0.9)
    rms = Optimizer(_model().parameters(), functopt.rmsprop(0.01, decay=0.95))
    assert rms.param_groups[0]["alpha"] == 0.95  # torch's name for the decay
    rprop = Optimizer(_model().parameters(), functopt.rprop(0.01))
    assert rprop.param_groups[0]["etas"] == (0.5, 1.2)


def test_every_table_row_names_real_recipe_arguments():
    import inspect

    for name, keys in _param_groups.RECIPE_GROUP_KEYS.items():
        params = set(inspect.signature(getattr(functopt, name)).parameters)
        args = {a for names in keys.values() for a in names}
        assert args <= params, (name, args - params)


@pytest.mark.parametrize("fused", [True, False])
def test_torch_schedulers_drive_a_plain_adamw_as_torchs(fused):
    ours, ref = _model(), _model()
    opt = Optimizer(ours.parameters(), functopt.adamw(1e-3, weight_decay=1e-2), fused=fused)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=1e-2)
    # OneCycleLR schedules lr and cycles betas[0]: both must reach the step.
    _train(ours, opt, LR_SCHED.OneCycleLR(opt, max_lr=0.05, total_steps=10))
    _train(ref, torch_opt, LR_SCHED.OneCycleLR(torch_opt, max_lr=0.05, total_steps=10))
    assert _max_diff(ours, ref) < 1e-12
    assert opt.param_groups[0]["betas"][0] == torch_opt.param_groups[0]["betas"][0] != 0.9


def test_fused_path_stays_fused_for_a_plain_recipe():
    model = _model()
    opt = Optimizer(model.parameters(), functopt.adamw(1e-3))
    got = functopt.fast.explain(opt.transform, list(model.parameters()))
    assert got.fast and got.groups[0].kernel == "torch._fused_adamw_", str(got)
    got = functopt.fast.explain(
        Optimizer(model.parameters(), functopt.sgd(0.1, momentum=0.9)).transform,
        list(model.parameters()))
    assert got.fast and got.groups[0].kernel == "torch._fused_sgd_", str(got)


def test_sgd_momentum_and_group_values_match_torch():
    ours, ref = _model(), _model()
    groups = lambda m: [{"params": m[0].parameters(), "lr": 0.02},  # noqa: E731
                        {"params": m[2].parameters()}]
    opt = Optimizer(groups(ours), functopt.sgd(0.1, momentum=0.9))
    torch_opt = torch.optim.SGD(groups(ref), lr=0.1, momentum=0.9)
    _train(ours, opt, LR_SCHED.StepLR(opt, step_size=2, gamma=0.5))
    _train(ref, torch_opt, LR_SCHED.StepLR(torch_opt, step_size=2, gamma=0.5))
    assert _max_diff(ours, ref) < 1e-12


@pytest.mark.parametrize("fused", [True, False])
def test_a_group_lr_of_zero_takes_effect(fused):
    model = _model()
    opt = Optimizer(model.parameters(), functopt.adamw(1e-2, weight_decay=0.1), fused=fused)
    _train(model, opt, steps=2)
    before = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[0]["lr"] = 0.0  # AdamW's decay is multiplied by lr too
    _train(model, opt, steps=2)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def test_unknown_group_keys_raise_at_construction_and_at_step():
    model = _model()
    with pytest.raises(ValueError, match="sets 'foo', which the transform does not read"):
        Optimizer([{"params": model.parameters(), "foo": 1}], functopt.adamw(1e-3))
    opt = Optimizer(model.parameters(), functopt.sgd(0.1))  # no momentum in this recipe
    opt.param_groups[0]["foo"] = 1
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="param_groups\\[0\\] sets 'foo'"):
        _train(model, opt, steps=1)
    del opt.param_groups[0]["foo"]
    opt.param_groups[0]["momentum"] = 0.9
    with pytest.raises(ValueError, match="sets 'momentum', but the transform has no"):
        _train(model, opt, steps=1)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    del opt.param_groups[0]["momentum"]
    LR_SCHED.OneCycleLR(opt, max_lr=0.1, total_steps=4, cycle_momentum=False)
    _train(model, opt, steps=1)  # the scheduler's own keys (initial_lr, max_lr, ...) are fine


def test_a_string_under_a_key_no_option_has_is_a_label_kept_as_torch_keeps_it():
    # torch keeps any key in a group; a string (a group's "name") is a label no step reads,
    # kept through steps and state dicts, in functopt.Optimizer and functopt.optim alike
    model = _model()
    ps = list(model.parameters())
    opt = Optimizer([{"params": ps[:1], "name": "weight"}, {"params": ps[1:]}],
                    functopt.adamw(1e-3))
    _train(model, opt, steps=1)
    assert opt.param_groups[0]["name"] == "weight"
    drop_in = functopt.optim.AdamW([{"params": ps[:1], "name": "weight"},
                                    {"params": ps[1:], "name": "bias"}])
    _train(model, drop_in, steps=2)
    saved = drop_in.state_dict()
    assert [g["name"] for g in saved["param_groups"]] == ["weight", "bias"]
    torch_side = torch.optim.AdamW([{"params": ps[:1], "name": "a"}, {"params": ps[1:]}])
    torch_side.load_state_dict(saved)
    assert [g.get("name") for g in torch_side.param_groups] == ["weight", "bias"]
    back = functopt.optim.AdamW([{"params": ps[:1]}, {"params": ps[1:]}])
    back.load_state_dict(torch_side.state_dict())
    _train(model, back, steps=1)
    assert [g["name"] for g in back.param_groups] == ["weight", "bias"]
    # a string under a torch option's key is an option that would be ignored: refused
    with pytest.raises(ValueError, match="sets 'adjust_lr_fn', but the transform has no"):
        functopt.optim.AdamW([{"params": ps, "adjust_lr_fn": "original"}])
    # and a number under an unknown key is still refused (a misspelt hyperparameter)
    with pytest.raises(ValueError, match="sets 'weight_deacy', which the transform does not"):
        functopt.optim.AdamW([{"params": ps, "weight_deacy": 0.1}])


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize(("recipe", "key", "value", "message"), [
    (lambda: functopt.adamw(1e-3), "betas", (1.0, 0.999), "b1 must be in \\[0, 1\\)"),
    (lambda: functopt.adamw(1e-3), "eps", -1.0, "eps must be in"),
    (lambda: functopt.sgd(0.1, momentum=0.9), "momentum", -0.5, "decay must be in"),
    (lambda: functopt.sgd(0.1), "lr", -0.1, "learning_rate must be in"),
])
def test_group_values_are_checked_on_every_path(fused, recipe, key, value, message):
    model = _model()
    opt = Optimizer(model.parameters(), recipe(), fused=fused)
    _train(model, opt, steps=1)
    before = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[0][key] = value
    with pytest.raises(ValueError, match=message):
        _train(model, opt, steps=1)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    with pytest.raises(ValueError, match=message):
        Optimizer([{"params": _model().parameters(), key: value}], recipe(), fused=fused)


def test_adafactor_groups_honour_its_keys_and_refuse_torchs_d_and_beta2_decay():
    model = _model()
    opt = Optimizer(model.parameters(), functopt.adafactor(1e-2))
    for key, says in (("d", "clipping_threshold"), ("beta2_decay", "decay_rate")):
        opt.param_groups[0][key] = 1.0
        with pytest.raises(ValueError, match=f"sets '{key}'.*{says}"):
            _train(model, opt, steps=1)
        del opt.param_groups[0][key]
    # Its own keys are read: a group edited to clipping_threshold=0.5 equals the recipe
    # built with 0.5 (the pure path, compared exactly).
    edited, built = _model(), _model()
    a = Optimizer(edited.parameters(), functopt.adafactor(1e-2), fused=False)
    a.param_groups[0]["clipping_threshold"] = 0.5
    a.param_groups[0]["decay_rate"] = 0.9
    b = Optimizer(built.parameters(), functopt.adafactor(1e-2, clipping_threshold=0.5,
                                                         decay_rate=0.9), fused=False)
    _train(edited, a, steps=3)
    _train(built, b, steps=3)
    assert _max_diff(edited, built) == 0.0
    unedited = _model()
    _train(unedited, Optimizer(unedited.parameters(), functopt.adafactor(1e-2), fused=False),
           steps=3)
    assert _max_diff(edited, unedited) > 0.0


@pytest.mark.parametrize("make", [
    lambda ps: Optimizer(ps, functopt.chain(functopt.add_decayed_weights(1e-2),
                                            functopt.sgd(0.1))),
    lambda ps: Optimizer(ps, functopt.sgd(0.1)),
    lambda ps: functopt.optim.SGD(ps, lr=0.1, weight_decay=1e-2),
    lambda ps: Optimizer(ps, functopt.adamw(0.1, weight_decay=1e-2)),
], ids=["stateless-chain-with-decay", "sgd", "optim.SGD", "adamw"])
def test_dcp_state_dict_helpers_never_change_the_weights(make):
    model = _model()
    opt = make(model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    saved = get_optimizer_state_dict(model, opt)
    set_optimizer_state_dict(model, opt, saved)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert all(p.grad is None for p in model.parameters())


def test_state_follows_the_params_dtype_like_torch():
    for clear in (False, True):
        ours, ref = _model(torch.float32), _model(torch.float32)
        opt = Optimizer(ours.parameters(), functopt.adamw(1e-3, weight_decay=1e-2))
        torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=1e-2)
        if clear:  # stepped in float32, then moved: cleared state restarts in float64
            _train(ours, opt, steps=1)
            _train(ref, torch_opt, steps=1)
            opt.state.clear()
            torch_opt.state.clear()
        ours.to(F64)
        ref.to(F64)
        _train(ours, opt, steps=2)
        _train(ref, torch_opt, steps=2)
        p = next(ours.parameters())
        assert opt.state[p]["inner_state.0.mu"].dtype == F64
        assert torch_opt.state[next(ref.parameters())]["exp_avg"].dtype == F64
        # (a float32 first step rounds differently in torch's foreach and the fused kernel)
        assert _max_diff(ours, ref) < (1e-6 if clear else 1e-12)


def test_cleared_state_restarts_from_init_not_from_the_donated_template():
    a, b = _model(), _model()
    opt_a = Optimizer(a.parameters(), functopt.adamw(1e-2))
    _train(a, opt_a, steps=3)
    opt_a.state.clear()
    _train(a, opt_a, steps=2)
    # The same as a fresh optimizer from a's params after its first three steps.
    ref = _model()
    _train(ref, Optimizer(ref.parameters(), functopt.adamw(1e-2)), steps=3)
    _train(ref, Optimizer(ref.parameters(), functopt.adamw(1e-2)), steps=2)
    assert _max_diff(a, ref) == 0.0
    del b


def test_load_matches_state_by_param_name_and_names_a_mismatch():
    model = _model()
    named = list(model.named_parameters())
    opt = Optimizer(named, functopt.adamw(1e-2))
    _train(model, opt, steps=2)
    saved = opt.state_dict()
    # The same model, its params registered in the other order: each gets its own state.
    again = Optimizer(list(reversed(named)), functopt.adamw(1e-2))
    again.load_state_dict(saved)
    for _, p in named:
        assert torch.equal(again.state[p]["inner_state.0.mu"], opt.state[p]["inner_state.0.mu"])
    renamed = [(f"m.{n}", p) for n, p in named]
    with pytest.raises(ValueError, match=r"\['m.0.bias'.*have no saved state.*\['0.bias'"):
        Optimizer(renamed, functopt.adamw(1e-2)).load_state_dict(saved)


# Importing inductor on the CPU defines torch.utils.mkldnn's ScriptModules, which warn.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.slow
def test_torch_compile_of_step_on_a_plain_recipe():
    model = _model(torch.float32)
    ref = _model(torch.float32)
    opt = Optimizer(model.parameters(), functopt.sgd(0.1, momentum=0.9), fused=False)
    torch_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    step = torch.compile(opt.step)
    x, y = _batch(torch.float32)
    for m, o, s in ((model, opt, step), (ref, torch_opt, torch_opt.step)):
        for _ in range(2):
            o.zero_grad()
            ((m(x) - y) ** 2).mean().backward()
            s()
    assert _max_diff(model, ref) < 1e-6


def test_the_docs_table_is_the_recipe_table():
    from pathlib import Path

    page = (Path(__file__).parents[1] / "docs" / "coming-from-torch-optim.md").read_text()
    for name, keys in _param_groups.RECIPE_GROUP_KEYS.items():
        cells = [f"`{key}`" if args == (key,) else f"`{key}` (`{', '.join(args)}`)"
                 for key, args in keys.items()]
        assert f"| `{name}` | {', '.join(cells)} |" in page, name


def test_load_names_a_recipe_that_does_not_match():
    model = _model()
    opt = Optimizer(model.parameters(), functopt.adamw(1e-2))
    _train(model, opt, steps=1)
    saved = opt.state_dict()
    assert saved["param_groups"][0]["functopt"]["transform"].startswith("adamw(")
    # adam and adamw(nesterov=True) keep the same state fields as adamw: only the record
    # tells them apart.
    with pytest.raises(ValueError, match=r"saved with transform 'adamw\(.*this optimizer has "
                                         r"'adam\("):
        Optimizer(model.parameters(), functopt.adam(1e-2)).load_state_dict(saved)
    with pytest.raises(ValueError, match=r"has 'adamw\(.*nesterov=True"):
        Optimizer(model.parameters(), functopt.adamw(1e-2, nesterov=True)).load_state_dict(saved)
    Optimizer(model.parameters(), functopt.adamw(1e-3)).load_state_dict(saved)  # lr may differ
    # A checkpoint of the format before 2 kept the records at the top level: still read.
    legacy = {"state": saved["state"], "functopt": {"transforms": ["adamw(x=1)"]},
              "param_groups": [{k: v for k, v in g.items() if k != "functopt"}
                               for g in saved["param_groups"]]}
    with pytest.raises(ValueError, match=r"saved with transform 'adamw\(x=1\)'"):
        Optimizer(model.parameters(), functopt.adamw(1e-2)).load_state_dict(legacy)
    legacy["functopt"]["transforms"] = [saved["param_groups"][0]["functopt"]["transform"]]
    Optimizer(model.parameters(), functopt.adamw(1e-2)).load_state_dict(legacy)


def test_the_named_state_dict_is_dcps_layout_and_loads_by_name():
    model = _model()
    opt = Optimizer(model.named_parameters(), functopt.adamw(1e-2, weight_decay=1e-2))
    _train(model, opt, steps=2)
    named = opt.named_state_dict()
    dcp = get_optimizer_state_dict(model, opt)
    assert set(named["state"]) == set(dcp["state"]) == {n for n, _ in model.named_parameters()}
    for name, entry in dcp["state"].items():
        assert entry.keys() == named["state"][name].keys()
        assert all(torch.equal(v, named["state"][name][k]) for k, v in entry.items())
    assert dcp["param_groups"][0]["params"] == named["param_groups"][0]["params"]
    # Loaded (from DCP's layout) into an optimizer listing the params in another order,
    # training continues exactly as the original does.
    twin = _model()
    twin.load_state_dict(model.state_dict())
    other = Optimizer(list(reversed(list(twin.named_parameters()))),
                      functopt.adamw(1e-2, weight_decay=1e-2))
    other.load_named_state_dict(dcp)
    _train(model, opt, steps=2)
    _train(twin, other, steps=2)
    assert _max_diff(model, twin) == 0.0
    with pytest.raises(ValueError, match="has no param_names"):
        Optimizer(model.parameters(), functopt.adamw(1e-2)).named_state_dict()


@pytest.mark.parametrize("fused", [True, False])
def test_decay_and_no_decay_groups_as_hf_builds_them_match_torch(fused):
    # HF Trainer's optimizer_cls_and_kwargs hands the optimizer groups that set weight_decay.
    def groups(m):
        return [{"params": [p for p in m.parameters() if p.dim() > 1], "weight_decay": 0.1},
                {"params": [p for p in m.parameters() if p.dim() <= 1], "weight_decay": 0.0}]

    ours, ref = _model(), _model()
    opt = Optimizer(groups(ours), functopt.adamw(1e-2, weight_decay=1e-4), fused=fused)
    torch_opt = torch.optim.AdamW(groups(ref), lr=1e-2)
    _train(ours, opt, LR_SCHED.LinearLR(opt, start_factor=0.5, total_iters=4))
    _train(ref, torch_opt, LR_SCHED.LinearLR(torch_opt, start_factor=0.5, total_iters=4))
    assert _max_diff(ours, ref) < 1e-12
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


@pytest.mark.parametrize("name", sorted(_param_groups.RECIPE_GROUP_KEYS))
def test_every_recipe_exposes_its_row_and_steps_as_the_recipe_itself(name):
    from functopt.optimizers import recipe_of

    kwargs = {"learning_rate": 1e-2}
    if name in ("sgd", "rmsprop", "lars", "adafactor"):
        kwargs["momentum"] = 0.5
    tx = getattr(functopt, name)(**kwargs)
    args = recipe_of(tx).arguments
    expected = {key for key, names in _param_groups.RECIPE_GROUP_KEYS[name].items()
                if all(isinstance(args[a], (int, float)) and not isinstance(args[a], bool)
                       for a in names)}
    model, ref = _model(), _model()
    opt = Optimizer(model.parameters(), tx, fused=False)
    assert set(opt.param_groups[0]) - {"params"} == expected
    assert "lr" in expected
    # Three steps equal the recipe's own pure update (to rounding: an injected weight decay
    # is a tensor product, the plain one torch's add(alpha=)).
    params = [p.detach().clone() for p in ref.parameters()]
    state = tx.init(params)
    x, y = _batch()
    for _ in range(3):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        with torch.no_grad():
            for p, q in zip(ref.parameters(), params, strict=True):
                p.copy_(q)
        ref.zero_grad()
        ((ref(x) - y) ** 2).mean().backward()
        updates, state = tx.update([p.grad for p in ref.parameters()], state, params)
        params = functopt.apply_updates(params, updates)
    diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), params,
                                                          strict=True))
    assert diff < 1e-12, diff


def test_a_zero_lr_is_checked_by_the_recipe_that_refuses_it():
    # rprop's learning rate is its initial step size, which must be > 0; the others take 0.
    model = _model()
    opt = Optimizer(model.parameters(), functopt.rprop(1e-2), fused=False)
    opt.param_groups[0]["lr"] = 0.0
    with pytest.raises(ValueError, match="scale_by_rprop: learning_rate must be in \\(0, inf\\)"):
        _train(model, opt, steps=1)
    opt.param_groups[0]["lr"] = 0.5  # any positive value is accepted without a rebuild
    _train(model, opt, steps=1)


def test_lr_mult_on_a_plain_recipe_multiplies_its_lr():
    a, b = _model(), _model()
    opt_a = Optimizer([{"params": a.parameters(), "lr_mult": 3.0}], functopt.sgd(0.01, 0.9))
    opt_b = Optimizer(b.parameters(), functopt.sgd(0.03, 0.9))
    _train(a, opt_a, steps=3)
    _train(b, opt_b, steps=3)
    assert _max_diff(a, b) < 1e-15
    assert opt_a.param_groups[0]["lr"] == 0.01 * 3.0  # the group holds the lr it steps with


@settings(max_examples=20, deadline=None)
@given(lr=st.floats(1e-4, 1e-1), b1=st.floats(0.0, 0.99), b2=st.floats(0.5, 0.9999),
       eps=st.floats(1e-10, 1e-3), wd=st.floats(0.0, 0.5), fused=st.booleans())
def test_editing_a_plain_recipes_group_equals_building_it_with_those_values(
        lr, b1, b2, eps, wd, fused):
    edited, built = _model(), _model()
    opt = Optimizer(edited.parameters(), functopt.adamw(1e-3), fused=fused)
    opt.param_groups[0].update(lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    ref = Optimizer(built.parameters(), functopt.adamw(lr, b1, b2, eps, weight_decay=wd),
                    fused=fused)
    _train(edited, opt, steps=2)
    _train(built, ref, steps=2)
    assert _max_diff(edited, built) == 0.0


def test_a_named_mixed_dtype_group_keeps_its_plan_and_state_across_steps():
    # The dtype/device check of a fresh state must not see a move where there is none
    # (named groups are dicts to the transform, whose order is not the group's).
    b = torch.nn.Parameter(torch.ones(3, dtype=torch.float32))
    a = torch.nn.Parameter(torch.ones(2, dtype=F64))
    opt = Optimizer([("b", b), ("a", a)], functopt.sgd(0.1))  # stateless: checked each step
    plan = None
    for _ in range(3):
        a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
        opt.step()
        assert plan is None or opt._plans[0] is plan
        plan = opt._plans[0]
    expected = torch.ones(2, dtype=F64)
    for _ in range(3):
        expected = expected - 0.1 * torch.ones(2, dtype=F64)
    torch.testing.assert_close(a.detach(), expected, rtol=0, atol=1e-15)
