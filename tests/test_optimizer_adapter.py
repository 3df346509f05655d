"""functopt.Optimizer (functopt/adapters/optimizer.py) against torch.optim.

Trajectories are compared in float64 to 1e-10 over 30 steps: the two sides compute the
same maths in a different order (torch's ``addcdiv_`` and ``mul_(1 - lr * wd)`` against
functopt's out-of-place chain), so they agree to rounding, not bitwise.
"""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch

import functopt
from functopt import Optimizer

F64 = torch.float64
TOL = 1e-10
LR_SCHED = torch.optim.lr_scheduler


def _init_params(dtype=F64):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(4, 3, generator=g, dtype=dtype), torch.randn(4, generator=g, dtype=dtype)]


def _loss(params, dtype=F64):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 3, generator=g, dtype=dtype)
    y = torch.randn(8, 4, generator=g, dtype=dtype)
    w, b = params
    return ((torch.tanh(x @ w.T + b) - y) ** 2).mean()


def _leaves(dtype=F64):
    return [torch.nn.Parameter(t.clone()) for t in _init_params(dtype)]


def _adamw_pair(lr=1e-2, wd=0.1):
    def torch_opt(params):
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)

    def functopt_opt(params):
        tx = functopt.inject_hyperparams(functopt.adamw)(
            learning_rate=lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=wd)
        return Optimizer(params, tx)

    return torch_opt, functopt_opt


def _sgd_pair(lr=0.05, momentum=0.9):
    def torch_opt(params):
        return torch.optim.SGD(params, lr=lr, momentum=momentum)

    def functopt_opt(params):
        tx = functopt.inject_hyperparams(functopt.sgd)(learning_rate=lr, momentum=momentum)
        return Optimizer(params, tx)

    return torch_opt, functopt_opt


def _train(make_opt, make_sched=None, steps=30, keys=("lr",)):
    params = _leaves()
    opt = make_opt(params)
    sched = make_sched(opt) if make_sched else None
    trajectory, group_values = [], []
    for _ in range(steps):
        opt.zero_grad()
        _loss(params).backward()
        opt.step()
        if sched is not None:
            sched.step()
        trajectory.append([p.detach().clone() for p in params])
        group_values.append([[g[k] for k in keys] for g in opt.param_groups])
    return trajectory, group_values


def _assert_close(traj_a, traj_b, tol=TOL):
    for step, (a, b) in enumerate(zip(traj_a, traj_b, strict=True)):
        for x, y in zip(a, b, strict=True):
            err = (x - y).abs().max().item()
            assert err <= tol, f"step {step}: max abs difference {err}"


SCHEDULERS = {
    "StepLR": lambda o: LR_SCHED.StepLR(o, step_size=7, gamma=0.5),
    "CosineAnnealingLR": lambda o: LR_SCHED.CosineAnnealingLR(o, T_max=30, eta_min=1e-4),
    "LambdaLR": lambda o: LR_SCHED.LambdaLR(o, lambda t: 1.0 / (1.0 + t)),
    "SequentialLR": lambda o: LR_SCHED.SequentialLR(
        o, [LR_SCHED.LinearLR(o, start_factor=0.1, total_iters=5),
            LR_SCHED.CosineAnnealingLR(o, T_max=25)], milestones=[5]),
    "OneCycleLR": lambda o: LR_SCHED.OneCycleLR(o, max_lr=0.05, total_steps=31),
}


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_schedulers_drive_adamw_like_torch(name):
    torch_opt, functopt_opt = _adamw_pair()
    keys = ("lr", "betas") if name == "OneCycleLR" else ("lr",)
    ref, ref_values = _train(torch_opt, SCHEDULERS[name], keys=keys)
    got, got_values = _train(functopt_opt, SCHEDULERS[name], keys=keys)
    _assert_close(ref, got)
    assert got_values == ref_values
    assert len({v[0][0] for v in got_values}) > 1  # the lr did move
    if name == "OneCycleLR":  # and betas[0] was cycled
        assert len({v[0][1][0] for v in got_values}) > 1


def test_one_cycle_momentum_cycling_sgd_like_torch():
    torch_opt, functopt_opt = _sgd_pair()
    make = SCHEDULERS["OneCycleLR"]
    ref, ref_values = _train(torch_opt, make, keys=("lr", "momentum"))
    got, got_values = _train(functopt_opt, make, keys=("lr", "momentum"))
    _assert_close(ref, got)
    assert got_values == ref_values
    assert len({v[0][1] for v in got_values}) > 1


def test_group_values_are_read_every_step():
    params = _leaves()
    _, functopt_opt = _sgd_pair(momentum=0.0)
    opt = functopt_opt(params)
    opt.param_groups[0]["lr"] = 0.0
    before = [p.detach().clone() for p in params]
    _loss(params).backward()
    lost = pytest.warns(functopt.fast.FastPathWarning, match="an injected momentum of 0")
    with lost:  # momentum 0 keeps a trace that the fused kernel does not write
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(params, before, strict=True))
    # A tensor lr, edited in place as schedulers do, is read afresh too (the lost fast
    # path, warned about above, may be warned about again or not).
    opt.param_groups[0]["lr"] = lr = torch.tensor(0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", functopt.fast.FastPathWarning)
        opt.step()
        assert all(torch.equal(p, q) for p, q in zip(params, before, strict=True))
        lr.fill_(0.5)
        opt.step()
    assert torch.allclose(params[1], before[1] - 0.5 * params[1].grad, rtol=0, atol=1e-15)


def test_param_groups_carry_injected_hyperparameters_under_torch_names():
    tx = functopt.inject_hyperparams(functopt.adamw)(learning_rate=0.1, weight_decay=0.0)
    opt = Optimizer(_leaves(), tx)
    group = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    assert group == {"lr": 0.1, "betas": (0.9, 0.999), "eps": 1e-8, "eps_root": 0.0,
                     "weight_decay": 0.0}
    assert opt.defaults == group
    lion = Optimizer(_leaves(), functopt.inject_hyperparams(functopt.lion)(learning_rate=0.1))
    assert "betas" in lion.param_groups[0]


def test_closure_runs_once_with_grad_enabled_and_loss_is_returned():
    torch_opt, functopt_opt = _adamw_pair()
    results = []
    for make in (torch_opt, functopt_opt):
        params = _leaves()
        opt = make(params)
        calls = []

        def closure(params=params, opt=opt, calls=calls):
            calls.append(torch.is_grad_enabled())
            opt.zero_grad()
            loss = _loss(params)
            loss.backward()
            return loss

        with torch.no_grad():  # Lightning calls step(closure) like this
            loss = opt.step(closure)
        assert calls == [True]
        assert torch.equal(loss, _loss(_init_params()))
        results.append([p.detach() for p in params])
    _assert_close([results[0]], [results[1]])


def test_params_without_grad_are_left_unchanged():
    params = _leaves()
    extra = torch.nn.Parameter(torch.ones(2, dtype=F64))
    _, functopt_opt = _adamw_pair()
    opt = functopt_opt([*params, extra])
    frozen = Optimizer([torch.nn.Parameter(torch.ones(1, dtype=F64))], opt._transform)
    state_before = dict(opt.state[extra])
    for _ in range(3):
        opt.zero_grad()
        _loss(params).backward()
        opt.step()
        frozen.step()
    assert torch.equal(extra, torch.ones(2, dtype=F64))
    assert all(opt.state[extra][k] is v for k, v in state_before.items()
               if k.endswith(("mu", "nu")))
    assert opt.state[params[0]]["count"] == 3
    # A group in which no param has a gradient is not stepped, as in torch.optim.
    assert frozen.state[frozen.param_groups[0]["params"][0]]["count"] == 0


def test_state_dict_round_trip_continues_bitwise():
    _, functopt_opt = _adamw_pair()
    make_sched = SCHEDULERS["CosineAnnealingLR"]

    def steps(params, opt, sched, n):
        for _ in range(n):
            opt.zero_grad()
            _loss(params).backward()
            opt.step()
            sched.step()

    params = _leaves()
    opt = functopt_opt(params)
    sched = make_sched(opt)
    steps(params, opt, sched, 20)
    expected = [p.detach().clone() for p in params]

    params = _leaves()
    opt = functopt_opt(params)
    sched = make_sched(opt)
    steps(params, opt, sched, 10)
    saved = opt.state_dict()
    snapshot = copy.deepcopy(saved)
    buffer = io.BytesIO()
    torch.save({"opt": saved, "sched": sched.state_dict(),
                "params": [p.detach() for p in params]}, buffer)
    steps(params, opt, sched, 1)  # moving on does not change a state dict taken before
    assert saved["state"][0]["inner_state.0.mu"].equal(snapshot["state"][0]["inner_state.0.mu"])
    assert saved["state"][0]["count"] == 10

    buffer.seek(0)
    checkpoint = torch.load(buffer)  # weights_only: the state dict is plain tensors and dicts
    params = [torch.nn.Parameter(t.clone()) for t in checkpoint["params"]]
    opt = functopt_opt(params)
    sched = make_sched(opt)
    opt.load_state_dict(checkpoint["opt"])
    sched.load_state_dict(checkpoint["sched"])
    steps(params, opt, sched, 10)
    assert all(torch.equal(p, q) for p, q in zip(params, expected, strict=True))

    # torch's layout: int keys, readable per-param entries, hyperparameters in the groups.
    assert set(saved["state"]) == {0, 1}
    assert set(saved["state"][1]) == {"count", "inner_state.0.count", "inner_state.0.mu",
                                      "inner_state.0.nu"}
    assert saved["param_groups"][0]["params"] == [0, 1]
    assert saved["param_groups"][0]["betas"] == (0.9, 0.999)


def test_load_state_dict_moves_to_the_transforms_dtype_and_restarts_empty_groups():
    _, functopt_opt = _adamw_pair()
    params = _leaves()
    opt = functopt_opt(params)
    _loss(params).backward()
    opt.step()
    saved = opt.state_dict()
    saved["state"][0] = {k: v.float() if v.is_floating_point() else v
                         for k, v in saved["state"][0].items()}
    fresh = functopt_opt(_leaves())
    fresh.load_state_dict(saved)
    p0 = fresh.param_groups[0]["params"][0]
    assert fresh.state[p0]["inner_state.0.mu"].dtype == F64
    assert fresh.state[p0]["count"] == 1
    fresh.load_state_dict({"state": {}, "param_groups": saved["param_groups"]})
    fresh.step()  # no grads: nothing moves
    assert all(entry == {} for entry in fresh.state.values())  # every param's entry empty
    fresh.param_groups[0]["params"][0].grad = torch.ones(4, 3, dtype=F64)
    fresh.step()
    assert fresh.state[p0]["count"] == 1  # restarted from init


def test_load_state_dict_hooks_fire():
    _, functopt_opt = _adamw_pair()
    opt = functopt_opt(_leaves())
    seen = []
    opt.register_load_state_dict_pre_hook(lambda o, sd: seen.append("pre"))
    opt.register_load_state_dict_post_hook(lambda o: seen.append("post"))
    opt.register_state_dict_post_hook(lambda o, sd: seen.append("save"))
    opt.load_state_dict(opt.state_dict())
    assert seen == ["save", "pre", "post"]


def _saved():
    _, functopt_opt = _adamw_pair()
    params = _leaves()
    opt = functopt_opt(params)
    _loss(params).backward()
    opt.step()
    return functopt_opt, opt.state_dict()


def test_load_state_dict_errors():
    functopt_opt, saved = _saved()
    opt = functopt_opt(_leaves())
    with pytest.raises(ValueError, match="keys 'state' and 'param_groups'"):
        opt.load_state_dict({"state": {}})
    with pytest.raises(ValueError, match="has 2 param groups, this optimizer 1"):
        opt.load_state_dict({**saved, "param_groups": saved["param_groups"] * 2})
    short = [{**saved["param_groups"][0], "params": [0]}]
    with pytest.raises(ValueError, match="has 2 params, the state dict's has 1"):
        opt.load_state_dict({**saved, "param_groups": short})
    ref = torch.optim.AdamW(_leaves())
    _loss(ref.param_groups[0]["params"]).backward()
    ref.step()
    with pytest.raises(ValueError, match=r"unexpected keys \['exp_avg'.*lacks \['count'"):
        opt.load_state_dict({"state": ref.state_dict()["state"],
                             "param_groups": saved["param_groups"]})
    bad = copy.deepcopy(saved)
    bad["state"][0]["inner_state.0.mu"] = torch.zeros(3, dtype=F64)
    with pytest.raises(ValueError, match=r"'inner_state.0.mu' of param 0 .* shape \(3,\)"):
        opt.load_state_dict(bad)
    bad = copy.deepcopy(saved)
    bad["state"][0]["count"] = 3
    with pytest.raises(TypeError, match="'count' = int; expected a tensor"):
        opt.load_state_dict(bad)
    bad = copy.deepcopy(saved)
    bad["state"][0] = [1]
    with pytest.raises(TypeError, match="is a list, expected a dict"):
        opt.load_state_dict(bad)
    # A failed load leaves the optimizer as it was.
    assert opt.state[opt.param_groups[0]["params"][0]]["count"] == 0


def test_grad_scaler_matches_torch_adamw():
    """GradScaler + functopt.Optimizer == GradScaler + torch AdamW in float32.

    The scale trajectory (with injected inf/nan) is identical; params agree to a relative
    1e-5 (measured: 7e-7, a few float32 ulps from the two orderings of Adam's maths over 20
    steps). The adapter itself adds no arithmetic: see the bitwise test below.
    """
    torch_opt, functopt_opt = _adamw_pair()
    runs = []
    for make in (torch_opt, functopt_opt):
        params = _leaves(torch.float32)
        opt = make(params)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
        scales = []
        for t in range(20):
            opt.zero_grad()
            scaler.scale(_loss(params, torch.float32)).backward()
            if t in (4, 9):
                params[0].grad[0, 0] = float("inf")
            if t == 10:
                params[1].grad[2] = float("nan")
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        runs.append((params, scales, opt))
    (ref, ref_scales, _), (got, got_scales, opt) = runs
    assert got_scales == ref_scales
    assert len(set(got_scales)) > 2
    for p, q in zip(ref, got, strict=True):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6)
    assert opt.state[got[0]]["count"] == 17  # the three overflowing steps were skipped


@pytest.mark.parametrize("fused", [False, True])
def test_equals_the_functional_loop_bitwise(fused: bool):
    """The adapter computes exactly the functional step, in float32: transform.update +
    apply_updates_ with fused=False, and make_step's fused kernel with fused=True."""
    tx = functopt.inject_hyperparams(functopt.adamw)(learning_rate=1e-2, weight_decay=0.1)
    assert functopt.fast.explain(tx, _init_params(torch.float32)).fast
    params = _leaves(torch.float32)
    opt = Optimizer(params, tx, fused=fused)
    ref = [t.clone() for t in _init_params(torch.float32)]
    state = tx.init(ref)
    fused_step = functopt.fast.make_step(tx)
    for t in range(10):
        opt.zero_grad()
        _loss(params, torch.float32).backward()
        opt.step()
        leaves = [r.clone().requires_grad_() for r in ref]
        grads = torch.autograd.grad(_loss(leaves, torch.float32), leaves)
        if fused:
            with torch.no_grad():
                ref, state = fused_step(list(grads), state, ref)
        else:
            updates, state = tx.update(list(grads), state, ref)
            ref = functopt.apply_updates(ref, updates)
        assert all(torch.equal(p, r) for p, r in zip(params, ref, strict=True)), t
    assert opt.state[params[0]]["inner_state.0.nu"].equal(state.inner_state[0].nu[0])


def test_step_hooks_fire():
    _, functopt_opt = _adamw_pair()
    params = _leaves()
    opt = functopt_opt(params)
    seen = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(("pre", params[1].clone())))
    opt.register_step_post_hook(lambda o, args, kwargs: seen.append(("post", params[1].clone())))
    before = params[1].detach().clone()
    _loss(params).backward()
    opt.step()
    assert [s for s, _ in seen] == ["pre", "post"]
    assert torch.equal(seen[0][1], before)
    assert torch.equal(seen[1][1], params[1])
    assert not torch.equal(seen[1][1], before)


def test_groups_with_different_options_match_torch():
    def groups(params):
        return [{"params": [params[0]]},
                {"params": [params[1]], "lr": 0.05, "weight_decay": 0.0, "betas": (0.8, 0.99)}]

    torch_opt, functopt_opt = _adamw_pair()
    ref, ref_values = _train(lambda p: torch_opt(groups(p)), SCHEDULERS["StepLR"])
    got, got_values = _train(lambda p: functopt_opt(groups(p)), SCHEDULERS["StepLR"])
    _assert_close(ref, got)
    assert got_values == ref_values
    assert got_values[0] == [[1e-2], [0.05]]


def test_add_param_group_gets_its_own_state():
    torch_opt, functopt_opt = _adamw_pair()
    trajectories = []
    for make in (torch_opt, functopt_opt):
        params = _leaves()
        opt = make([params[0]])
        for t in range(20):
            if t == 10:
                opt.add_param_group({"params": [params[1]], "lr": 0.05, "weight_decay": 0.0})
                if isinstance(opt, Optimizer):
                    assert opt.state[params[1]]["count"] == 0  # eager, fresh state
                    assert opt.state[params[0]]["count"] == 10
                    assert opt.param_groups[1]["betas"] == (0.9, 0.999)  # defaults
            opt.zero_grad()
            _loss(params).backward()
            opt.step()
        trajectories.append([p.detach() for p in params])
    _assert_close([trajectories[0]], [trajectories[1]])


def test_named_parameters_reach_the_transform_by_name():
    """A weight-decay mask by name equals torch's decay / no-decay groups."""
    def torch_opt(params):
        return torch.optim.AdamW([{"params": [params[0]]},
                                  {"params": [params[1]], "weight_decay": 0.0}],
                                 lr=1e-2, weight_decay=0.1)

    def functopt_opt(params):
        tx = functopt.inject_hyperparams(functopt.adamw, static_args="mask")(
            learning_rate=1e-2, weight_decay=0.1,
            mask=lambda p: {k: not k.endswith("bias") for k in p})
        return Optimizer(zip(["layer.weight", "layer.bias"], params, strict=True), tx)

    ref, _ = _train(torch_opt)
    got, _ = _train(functopt_opt)
    _assert_close(ref, got)
    opt = functopt_opt(_leaves())
    assert opt.param_groups[0]["param_names"] == ["layer.weight", "layer.bias"]
    assert set(opt.state_dict()["state"]) == {0, 1}


def test_clearing_the_state_restarts_and_partial_state_fails():
    _, functopt_opt = _adamw_pair()
    params = _leaves()
    opt = functopt_opt(params)
    _loss(params).backward()
    opt.step()
    opt.state.clear()
    opt.step()
    assert opt.state[params[0]]["count"] == 1
    del opt.state[params[1]]["inner_state.0.mu"]
    with pytest.raises(ValueError, match=r"param 1 of param_groups\[0\] has no 'inner_state.0.mu'"):
        opt.step()


def test_deepcopy_gives_an_independent_optimizer():
    _, functopt_opt = _adamw_pair()
    params = _leaves()
    opt = functopt_opt(params)
    _loss(params).backward()
    opt.step()
    twin = copy.deepcopy(opt)  # copies params and state, not grads
    _loss(twin.param_groups[0]["params"]).backward()
    twin.step()
    assert opt.state[params[0]]["count"] == 1
    assert twin.state[twin.param_groups[0]["params"][0]]["count"] == 2


def test_a_transform_no_recipe_built_has_no_hyperparameters_to_schedule():
    # A chain of the user's own (no recipe record): nothing in the groups a step would read.
    tx = functopt.chain(functopt.scale_by_adam(), functopt.scale(-1e-2))
    opt = Optimizer(_leaves(), tx)
    assert set(opt.param_groups[0]) == {"params"}
    assert type(opt.param_groups[0]) is dict
    with pytest.raises(KeyError, match="lr"):
        LR_SCHED.StepLR(opt, step_size=1)
    with pytest.raises(ValueError, match="sets 'lr', but the transform has no hyperparameter"):
        Optimizer([{"params": _leaves(), "lr": 0.1}], tx)


def test_bad_params_and_transforms():
    tx = functopt.inject_hyperparams(functopt.adamw)(learning_rate=1e-2)
    with pytest.raises(TypeError, match="got a single tensor of shape"):
        Optimizer(torch.nn.Parameter(torch.ones(2)), tx)
    with pytest.raises(ValueError, match="empty parameter list"):
        Optimizer([], tx)
    with pytest.raises(TypeError, match="did you pass the factory"):
        Optimizer(_leaves(), functopt.adamw)
    with pytest.raises(TypeError, match="expected a dict such as"):
        Optimizer(_leaves(), tx).add_param_group([torch.ones(1)])
    with pytest.raises(ValueError, match="names several params"):
        Optimizer([("w", torch.nn.Parameter(torch.ones(1))),
                   ("w", torch.nn.Parameter(torch.ones(1)))], tx)
    with pytest.raises(ValueError, match="sets 'learning_rate', which its groups call 'lr'"):
        Optimizer([{"params": _leaves(), "learning_rate": 0.1}], tx)
    with pytest.raises(ValueError, match=r"\['betas'\] must be a 2-tuple \(b1, b2\)"):
        Optimizer([{"params": _leaves(), "betas": 0.9}], tx)
    with pytest.raises(TypeError, match=r"\['lr'\] .* must be a number or a one-element tensor"):
        Optimizer([{"params": _leaves(), "lr": "0.1"}], tx)

    def clashing(learning_rate=0.1, lr=0.2):
        return functopt.scale(-learning_rate)

    with pytest.raises(ValueError, match="named 'lr', which clashes"):
        Optimizer(_leaves(), functopt.inject_hyperparams(clashing)())
    opt = Optimizer(_leaves(), tx)
    with pytest.raises(ValueError, match="sets 'momentum', but the transform"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(1))], "momentum": 0.9})
    assert len(opt.param_groups) == 1  # the failed group was not kept


def test_sparse_gradient_is_rejected():
    tx = functopt.inject_hyperparams(functopt.sgd)(learning_rate=0.1)
    emb = torch.nn.Embedding(4, 2, sparse=True)
    opt = Optimizer(emb.parameters(), tx)
    emb(torch.tensor([1])).sum().backward()
    with pytest.raises(TypeError, match=r"has a torch\.sparse_coo gradient"):
        opt.step()


def _custom(init_state, new_state):
    return functopt.GradientTransformation(
        lambda params: init_state(params),
        lambda updates, state, params=None: (updates, new_state(state)),
    )


def test_transform_state_errors():
    changing = _custom(lambda p: (torch.zeros(()),), lambda s: (s[0], s[0]))
    opt = Optimizer(_leaves(), changing, fused=False)
    opt.param_groups[0]["params"][0].grad = torch.zeros(4, 3, dtype=F64)
    with pytest.raises(ValueError, match="returned a state of structure"):
        opt.step()
    clashing = _custom(lambda p: {"a.b": torch.zeros(()), "a": {"b": [torch.zeros(1)]}},
                       lambda s: s)
    with pytest.raises(ValueError, match=r"paths \['a.b'\], which would share a key"):
        Optimizer([torch.nn.Parameter(torch.zeros(1))], clashing)


def test_partitioned_state_round_trip_and_empty_group():
    """Per-param fields that are None for some params (partition) have no entry there."""
    tx = functopt.partition(
        {"w": functopt.inject_hyperparams(functopt.adam)(learning_rate=1e-2),
         "b": functopt.sgd(0.1, momentum=0.9)},
        lambda p: {k: k[-1] for k in p},
    )

    def make(params):
        opt = Optimizer(zip(["w", "b"], params, strict=True), tx)
        opt.add_param_group({"params": [], "param_names": []})
        return opt

    params = _leaves()
    opt = make(params)
    for _ in range(3):
        opt.zero_grad()
        _loss(params).backward()
        opt.step()
    assert "inner_states.b.0.trace" in opt.state[params[1]]
    assert "inner_states.b.0.trace" not in opt.state[params[0]]
    assert not any("trace" in k for k in opt.state[params[0]])
    saved = opt.state_dict()
    twin_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin = make(twin_params)
    twin.load_state_dict(saved)
    for o, ps in ((opt, params), (twin, twin_params)):
        o.zero_grad()
        _loss(ps).backward()
        o.step()
    assert all(torch.equal(p, q) for p, q in zip(params, twin_params, strict=True))


# --- schedule-free: train / eval -----------------------------------------------------------


def _schedule_free_run(switch_at: int | None,
                       ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).double()
    opt = Optimizer(model.parameters(), functopt.contrib.schedule_free_adamw(0.05), fused=False)
    x = torch.randn(16, 4, dtype=torch.float64)
    evals = None
    for t in range(8):
        if t == switch_at:
            before = [p.detach().clone() for p in model.parameters()]
            opt.eval()
            opt.eval()  # a no-op the second time
            evals = [p.detach().clone() for p in model.parameters()]
            with pytest.raises(RuntimeError, match=r"call optimizer.train\(\) before"):
                opt.step()
            opt.train()
            assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before,
                                                         strict=True))
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], evals


def test_schedule_free_eval_moves_to_x_and_train_restores_bitwise() -> None:
    """eval() puts schedule_free_eval_params(state, y) in the params; train() restores y
    bitwise, and training continues exactly as without the switch."""
    plain, _ = _schedule_free_run(None)
    switched, evals = _schedule_free_run(4)
    assert all(torch.equal(a, b) for a, b in zip(plain, switched, strict=True))
    # the evaluation point is the averaged iterate, away from the training params
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).double()
    tx = functopt.contrib.schedule_free_adamw(0.05)
    params = dict(model.named_parameters())
    state = tx.init({k: p.detach() for k, p in params.items()})
    x = torch.randn(16, 4, dtype=torch.float64)
    for _ in range(4):
        loss = model(x).pow(2).mean()
        grads = dict(zip(params, torch.autograd.grad(loss, list(params.values())),
                         strict=True))
        updates, state = tx.update(grads, state, {k: p.detach() for k, p in params.items()})
        with torch.no_grad():
            for k, p in params.items():
                p.add_(updates[k])
    want = functopt.contrib.schedule_free_eval_params(
        state, {k: p.detach() for k, p in params.items()})
    assert evals is not None
    assert all(torch.allclose(e, want[k], rtol=1e-12, atol=1e-15)
               for e, k in zip(evals, ["weight", "bias"], strict=True))
    assert not torch.equal(evals[0], params["weight"])


def test_eval_without_schedule_free_is_a_clear_error() -> None:
    opt = Optimizer([torch.nn.Parameter(torch.zeros(2))], functopt.adamw(1e-3))
    with pytest.raises(TypeError, match="0 schedule_free stages"):
        opt.eval()
    opt.train()  # in train mode already: nothing to do


def test_schedule_free_eval_with_named_params_writes_each_param_its_own_point() -> None:
    """Named params: the state tree is a dict (flattened by sorted key), the group lists
    the params in the module's order; eval() must pair them by name (it paired them by
    position: a size error here, or silently swapped values for equal shapes)."""
    def run(named: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 4),
                                    torch.nn.Linear(4, 2)).double()
        given = model.named_parameters() if named else model.parameters()
        opt = Optimizer(given, functopt.contrib.schedule_free_adamw(0.05), fused=False)
        x = torch.randn(5, 3, dtype=torch.float64)
        for _ in range(3):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        opt.eval()
        return {k: v.detach().clone() for k, v in model.named_parameters()}

    by_name, by_position = run(True), run(False)
    assert all(torch.equal(by_name[k], by_position[k]) for k in by_name)
