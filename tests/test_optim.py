"""functopt.optim against torch.optim, on torch's own optimizer test database (optim_db).

Golden values come from torch.optim itself: for every configuration that
``torch.testing._internal.common_optimizers.optim_db`` lists for the eleven optimizers, the
functopt class and torch's class train the same float64 params for 10 steps (past RAdam's
switch to the rectified step at t = 6) and must agree to 1e-10 of the largest param. Every
constructor error input of optim_db must raise the same exception type (or warning) with
torch's message. The rest checks what a drop-in needs beyond the maths: the fused kernels
where torch's maths allows them, param groups that schedulers move, options fixed per
optimizer that refuse to be silently ignored, checkpoints and copies.
"""

from __future__ import annotations

import copy
import pickle
import re
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing._internal.common_optimizers import OptimizerErrorEnum, optim_db

import functopt
from functopt import optim

NAMES = ["Adam", "AdamW", "SGD", "RMSprop", "Adagrad", "NAdam", "RAdam", "Adamax",
         "Adadelta", "Rprop", "Adafactor"]
ENTRIES = {entry.optim_cls.__name__: entry for entry in optim_db
           if entry.optim_cls.__name__ in NAMES}
STEPS = 10
CLASSES = [name for name in optim.__all__ if isinstance(getattr(optim, name), type)]


def test_every_name_is_in_optim_db() -> None:
    # (Muon, for matrices only, and muon_split have their own tests:
    # tests/test_optim_muon.py)
    assert sorted(ENTRIES) == sorted(NAMES)
    assert sorted(optim.__all__) == sorted([*NAMES, "Muon", "muon_split"])
    for name in CLASSES:
        assert issubclass(getattr(optim, name), torch.optim.Optimizer)


def _start() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(3, 4, generator=g, dtype=torch.float64),
            torch.randn(3, generator=g, dtype=torch.float64),
            torch.randn((), generator=g, dtype=torch.float64)]


_X = torch.randn(8, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
_Y = torch.randn(8, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)


def _loss(ps: list[torch.Tensor]) -> torch.Tensor:
    w, b, s = ps
    return ((torch.tanh(_X @ w.T + b) * s - _Y) ** 2).mean()


def _train(cls: type, kwargs: dict[str, Any], steps: int = STEPS) -> list[torch.Tensor]:
    ps = [torch.nn.Parameter(p.clone()) for p in _start()]
    opt = cls(ps, **kwargs)
    for _ in range(steps):
        opt.zero_grad()
        _loss(ps).backward()
        opt.step()
    return [p.detach() for p in ps]


def _configs() -> list[Any]:
    out = []
    for name in NAMES:
        for config in ENTRIES[name].optim_inputs_func(device="cpu"):
            out.append(pytest.param(name, config.desc, id=f"{name}-{config.desc}"))
    return out


def _config(name: str, desc: str) -> dict[str, Any]:
    found = [c for c in ENTRIES[name].optim_inputs_func(device="cpu") if c.desc == desc]
    assert len(found) == 1 and found[0].params is None
    return dict(found[0].kwargs)


@pytest.mark.parametrize(("name", "desc"), _configs())
def test_matches_torch_on_optim_db(name: str, desc: str, float64_default: None) -> None:
    kwargs = _config(name, desc)
    expected = _train(ENTRIES[name].optim_cls, kwargs)
    got = _train(getattr(optim, name), kwargs)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == torch.float64
        scale = e.abs().max().item()
        assert (g - e).abs().max().item() <= 1e-10 * scale, (name, desc)
    # and the run moved the params, so the comparison is not vacuous
    assert max((e - s).abs().max().item() for e, s in zip(expected, _start(), strict=True)) > 0


def _error_inputs() -> list[Any]:
    out = []
    for name in NAMES:
        for e in ENTRIES[name].optim_error_inputs_func(device="cpu", dtype=torch.float64):
            if e.error_on == OptimizerErrorEnum.CONSTRUCTION_ERROR:
                out.append(pytest.param(name, e, id=f"{name}-{e.optimizer_error_input.desc}"))
    return out


@pytest.mark.parametrize(("name", "error"), _error_inputs())
def test_rejects_optim_db_error_inputs(name: str, error: Any) -> None:
    cls = getattr(optim, name)
    given = error.optimizer_error_input
    if issubclass(error.error_type, Warning):
        with pytest.warns(error.error_type, match=error.error_regex):
            cls(given.params, **given.kwargs)
    else:
        with pytest.raises(error.error_type, match=error.error_regex):
            cls(given.params, **given.kwargs)


def test_optim_db_has_construction_errors_for_every_class() -> None:
    counts = {name: sum(1 for e in ENTRIES[name].optim_error_inputs_func(
        device="cpu", dtype=torch.float64) if e.error_on == OptimizerErrorEnum.CONSTRUCTION_ERROR)
        for name in NAMES}
    assert all(n >= 7 for n in counts.values()), counts


# --- the fused kernels -------------------------------------------------------------------

def _mlp_params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(3)
    shapes = [(64, 32), (64,), (64, 64), (64,), (10, 64), (10,)]
    return [torch.nn.Parameter(torch.randn(s, generator=g) * 0.1) for s in shapes]


@pytest.mark.parametrize(("name", "kwargs", "kernel"), [
    ("AdamW", {}, "torch._fused_adamw_"),
    ("Adam", {}, "torch._fused_adamw_"),
    ("Adam", {"weight_decay": 0.1, "decoupled_weight_decay": True}, "torch._fused_adamw_"),
    ("SGD", {"lr": 0.1}, "torch._fused_sgd_"),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1, "nesterov": True},
     "torch._fused_sgd_"),
])
def test_fused_where_torch_math_allows(name: str, kwargs: dict[str, Any], kernel: str) -> None:
    ps = _mlp_params()
    opt = getattr(optim, name)(ps, **kwargs)
    explained = functopt.fast.explain(opt.transform, list(ps))
    assert explained.fast, explained.reason
    assert {g.kernel for g in explained.groups} == {kernel}
    # the fused step equals torch's own (float32 here: the kernel runs in the params' dtype)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    torch_opt = getattr(torch.optim, name)(ref, **kwargs)
    g = torch.Generator().manual_seed(4)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=g) for p in ps]
        for p, q, gr in zip(ps, ref, grads, strict=True):
            p.grad, q.grad = gr.clone(), gr.clone()
        opt.step()
        torch_opt.step()
    for p, q in zip(ps, ref, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("name", "kwargs"), [
    ("Adam", {"amsgrad": True}), ("Adam", {"weight_decay": 0.1}), ("AdamW", {"maximize": True}),
    ("Adam", {"amsgrad": True, "weight_decay": 0.1, "maximize": True}),
    ("SGD", {"momentum": 0.9, "maximize": True, "weight_decay": 0.1}),
])
def test_torch_options_with_a_kernel_stay_fused(name: str, kwargs: dict[str, Any]) -> None:
    """amsgrad, maximize and Adam's L2 weight_decay have PyTorch kernels (the planner
    lowers them): the step is fused and equals torch.optim's."""
    ps = _mlp_params()
    ref = [p.detach().clone().requires_grad_() for p in ps]
    opt = getattr(optim, name)(ps, **kwargs)
    torch_opt = getattr(torch.optim, name)(ref, **kwargs)
    assert functopt.fast.explain(opt.transform, list(ps)).fast
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        grads = [torch.randn(p.shape, generator=g) for p in ps]
        for p, q, gr in zip(ps, ref, grads, strict=True):
            p.grad, q.grad = gr.clone(), gr.clone()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opt.step()
        torch_opt.step()
    for p, q in zip(ps, ref, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("name", "kwargs"), [("RMSprop", {}), ("Rprop", {})])
def test_pure_path_without_a_warning(name: str, kwargs: dict[str, Any]) -> None:
    ps = _mlp_params()
    opt = getattr(optim, name)(ps, **kwargs)
    assert not functopt.fast.explain(opt.transform, list(ps)).fast
    for p in ps:
        p.grad = torch.ones_like(p)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch.optim's foreach path is silent; so is this
        opt.step()


def test_fused_true_without_a_kernel_warns() -> None:
    ps = [torch.nn.Parameter(p.detach().bfloat16()) for p in _mlp_params()]
    opt = optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.5, fused=True)
    # dampening has torch._fused_sgd_'s; bfloat16 on the CPU does not (a torch bug)
    assert functopt.fast.explain(optim.SGD(_mlp_params(), lr=0.1, momentum=0.9,
                                           dampening=0.5).transform, list(_mlp_params())).fast
    for p in ps:
        p.grad = torch.ones_like(p)
    with pytest.warns(functopt.fast.FastPathWarning, match="191763"):
        opt.step()


# --- param groups ------------------------------------------------------------------------

def test_groups_hold_torch_keys_and_schedulers_move_lr() -> None:
    w, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(1))
    opt = optim.AdamW([{"params": [w]}, {"params": [b], "weight_decay": 0.0, "lr": 0.5}],
                      lr=0.1)
    torch_opt = torch.optim.AdamW([{"params": [torch.nn.Parameter(torch.ones(2))]}], lr=0.1)
    assert set(torch_opt.param_groups[0]) - {"initial_lr"} <= set(opt.param_groups[0])
    assert opt.param_groups[1]["weight_decay"] == 0.0 and opt.param_groups[1]["lr"] == 0.5
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    for _ in range(3):
        w.grad, b.grad = torch.ones(2), torch.ones(1)
        opt.step()
        sched.step()
    assert opt.param_groups[0]["betas"][0] != 0.9  # OneCycleLR cycles beta1


def test_lr_written_to_a_group_is_used() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    opt = optim.SGD([p], lr=0.1, momentum=0.9)
    opt.param_groups[0]["lr"] = 0.0
    p.grad = torch.ones(3)
    opt.step()
    assert torch.equal(p.detach(), torch.ones(3))


def test_an_option_is_read_until_the_first_step_then_a_change_raises() -> None:
    # torch.optim reads amsgrad at every step; functopt builds the group's chain from it,
    # so a change before the first step is honoured, one after it (the state is the old
    # chain's) raises, naming the key and both values
    a, ra = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt, ref = optim.Adam([a], lr=0.1), torch.optim.Adam([ra], lr=0.1)
    for o in (opt, ref):
        o.param_groups[0]["amsgrad"] = True
    for t in range(3):
        a.grad = torch.full((2,), 0.5 if t else 2.0)
        ra.grad = a.grad.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(a.detach(), ra.detach(), rtol=0, atol=1e-7)
    assert "max_exp_avg_sq" in opt.state_dict()["state"][0]
    opt.param_groups[0]["amsgrad"] = False
    with pytest.raises(ValueError, match=r"param_groups\[0\] changed amsgrad=True -> False "
                                         r"after its first step.*Fix:"):
        opt.step()
    # a weight decay that is 0 everywhere has no stage; one written after a step raises
    b = torch.nn.Parameter(torch.ones(1))
    opt = optim.Adam([b])
    b.grad = torch.ones(1)
    opt.step()
    opt.param_groups[0]["weight_decay"] = 0.1
    with pytest.raises(ValueError, match=r"changed weight_decay=0 -> 0\.1"):
        opt.step()


def test_a_group_weight_decay_adds_the_stage() -> None:
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = optim.Adam([{"params": [a]}, {"params": [b], "weight_decay": 0.5}], lr=0.1)
    ref = torch.optim.Adam([{"params": [ra := torch.nn.Parameter(torch.ones(2))]},
                            {"params": [rb := torch.nn.Parameter(torch.ones(2))],
                             "weight_decay": 0.5}], lr=0.1)
    for _ in range(3):
        for p in (a, b, ra, rb):
            p.grad = torch.full((2,), 0.1)
        opt.step()
        ref.step()
    torch.testing.assert_close(a.detach(), ra.detach())
    torch.testing.assert_close(b.detach(), rb.detach())
    assert not torch.equal(a.detach(), b.detach())


def test_hints_are_accepted_and_kept_in_the_groups() -> None:
    p = torch.nn.Parameter(torch.ones(1))
    opt = optim.AdamW([p], foreach=True, capturable=True)
    assert opt.param_groups[0]["foreach"] is True
    assert opt.param_groups[0]["capturable"] is True
    assert optim.AdamW([p], differentiable=True).param_groups[0]["differentiable"] is True


@pytest.mark.parametrize("name", ["Adam", "AdamW", "NAdam", "RAdam", "Adamax", "RMSprop",
                                  "Adadelta", "Rprop"])
def test_capturable_on_the_cpu_raises_at_the_step_as_torch_does(name: str) -> None:
    # a CUDA graph cannot record a CPU step: torch's AssertionError, with its message
    p, q = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    ours, theirs = getattr(optim, name)([p], capturable=True), \
        getattr(torch.optim, name)([q], capturable=True)
    ours.step()  # no gradient: nothing steps, nothing to refuse (torch's too)
    theirs.step()
    p.grad, q.grad = torch.ones(2), torch.ones(2)
    with pytest.raises(AssertionError) as torch_error:
        theirs.step()
    with pytest.raises(AssertionError, match="param 0 of param_groups\\[0\\] is on cpu") as error:
        ours.step()
    assert str(error.value).startswith(str(torch_error.value))
    assert torch.equal(p.detach(), torch.ones(2))  # refused before it moved anything


def test_state_dict_round_trip_and_copies() -> None:
    ps = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))]
    opt = optim.RMSprop(ps, lr=0.01, momentum=0.5, centered=True)
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    clone = pickle.loads(pickle.dumps(opt))
    assert clone.param_groups[0]["centered"] is True
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    other = optim.RMSprop(qs, lr=0.01, momentum=0.5, centered=True)
    other.load_state_dict(saved)
    for p, q in zip(ps, qs, strict=True):
        p.grad, q.grad = torch.full_like(p, 0.3), torch.full_like(q, 0.3)
    opt.step()
    other.step()
    for p, q in zip(ps, qs, strict=True):
        assert torch.equal(p.detach(), q.detach())


# --- properties against torch on random hyperparameters ----------------------------------

@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(NAMES), lr=st.floats(1e-4, 0.1), wd=st.floats(0.0, 0.5),
       maximize=st.booleans(), seed=st.integers(0, 2**16))
def test_random_configs_match_torch(name: str, lr: float, wd: float, maximize: bool,
                                    seed: int) -> None:
    kwargs: dict[str, Any] = {"lr": lr, "maximize": maximize}
    if name != "Rprop":
        kwargs["weight_decay"] = wd
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        g = torch.Generator().manual_seed(seed)
        start = [torch.randn(4, 3, generator=g), torch.randn(5, generator=g)]
        grads = [[torch.randn(p.shape, generator=g) for p in start] for _ in range(7)]
        results = []
        for cls in (getattr(torch.optim, name), getattr(optim, name)):
            ps = [torch.nn.Parameter(p.clone()) for p in start]
            opt = cls(ps, **kwargs)
            for step in grads:
                for p, gr in zip(ps, step, strict=True):
                    p.grad = gr.clone()
                opt.step()
            results.append([p.detach() for p in ps])
    finally:
        torch.set_default_dtype(before)
    for e, got in zip(*results, strict=True):
        assert (got - e).abs().max().item() <= 1e-10 * max(1.0, e.abs().max().item())


def test_error_messages_say_what_and_how() -> None:
    with pytest.raises(ValueError, match=re.escape("Invalid beta parameter at index 1: 1.0") +
                       ".*expected 0 <= betas"):
        optim.NAdam([torch.nn.Parameter(torch.ones(1))], betas=(0.9, 1.0))


def test_group_values_are_range_checked() -> None:
    a, b = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
    with pytest.raises(ValueError, match=r"param_groups\[1\] holds .*'betas': \(1.0, 0.999\).*b1 must be"):
        optim.Adam([{"params": [a]}, {"params": [b], "betas": (1.0, 0.999)}])
    opt = optim.SGD([a], lr=0.1, momentum=0.9)
    opt.param_groups[0]["momentum"] = -1.0
    a.grad = torch.ones(1)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['momentum'\] is -1.0"):
        opt.step()
    assert torch.equal(a.detach(), torch.ones(1))  # nothing was written


def test_grad_scaler_drives_it_as_torch_optim() -> None:
    results = []
    for cls in (torch.optim.AdamW, optim.AdamW):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = cls(model.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        x, y = torch.randn(16, 4), torch.randn(16, 2)
        for step in range(4):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            if step == 2:
                loss = loss * float("inf")  # an overflow: the step is skipped
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        results.append(([p.detach().clone() for p in model.parameters()], scaler.get_scale()))
    (torch_params, torch_scale), (ours, our_scale) = results
    assert our_scale == torch_scale == 2.0**9
    for a, b in zip(ours, torch_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# functopt's own options: keyword only, after torch's (every class: compile=False)
EXTRA_OPTIONS: dict[str, dict[str, Any]] = {
    name: {**({"ns_dtype": torch.bfloat16} if name == "Muon" else {}), "compile": False}
    for name in CLASSES}


@pytest.mark.parametrize("name", CLASSES)
def test_signatures_and_defaults_are_torchs(name: str) -> None:
    # A straight swap keeps every default (AdamW's weight_decay=1e-2, not optax's 1e-4).
    import inspect

    ours = dict(inspect.signature(getattr(optim, name)).parameters)
    theirs = inspect.signature(getattr(torch.optim, name)).parameters
    extras = EXTRA_OPTIONS.get(name, {})
    assert list(ours)[len(theirs):] == list(extras)
    for key, default in extras.items():
        assert ours[key].kind == ours[key].KEYWORD_ONLY, key
        assert ours.pop(key).default == default, key
    assert list(ours) == list(theirs)
    for key, parameter in theirs.items():
        assert ours[key].kind == parameter.kind, key
        assert _same_default(ours[key].default, parameter.default), key
    if name == "AdamW":
        p = torch.nn.Parameter(torch.ones(1))
        assert optim.AdamW([p]).param_groups[0]["weight_decay"] == 1e-2


def _same_default(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and bool((a == b).all())
    return a == b


@pytest.mark.parametrize("name", [n for n in CLASSES if n not in ("SGD", "Adagrad")])
def test_a_sparse_gradient_is_refused_with_torchs_error(name: str) -> None:
    # (torch's SGD and Adagrad step sparse gradients; the others raise at the step)
    messages = []
    for cls in (getattr(optim, name), getattr(torch.optim, name)):
        p = torch.nn.Parameter(torch.ones(3, 2))
        opt = cls([p], lr=0.1)
        p.grad = torch.ones(3, 2).to_sparse()
        with pytest.raises(RuntimeError) as raised:
            opt.step()
        messages.append(str(raised.value))
    ours, theirs = messages
    assert ours.startswith(theirs) and "param 0 of param_groups[0]" in ours
