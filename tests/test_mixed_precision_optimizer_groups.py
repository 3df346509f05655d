"""MixedPrecisionOptimizer wherever an optimizer goes: a torch.optim.Optimizer whose
param_groups torch's and Megatron's schedulers drive, built from a torch optimizer, with
Megatron-LM's optimizer surface and schedule-free train()/eval().

References: torch.optim (Adam, AdamW, SGD and its lr_scheduler) in float64, Megatron-LM's
rules (clip_grad_by_total_norm_fp32's coefficient, the grad-norm skip), and functopt.Optimizer
for schedule-free.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functopt
from functopt import contrib
from functopt.adapters import MixedPrecisionOptimizer, _state_dict

F64 = torch.float64


def _model(dtype: torch.dtype = F64, seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(),
                               torch.nn.Linear(4, 1)).to(dtype)


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 3, generator=g, dtype=F64)
    dtype = next(model.parameters()).dtype
    return (model(x.to(dtype)).double() - x.sum(1, keepdim=True).sin()).pow(2).mean()


def _groups(model: torch.nn.Module) -> list[dict]:
    return [{"params": [model[0].weight, model[2].weight]},
            {"params": [model[0].bias, model[2].bias], "lr": 0.02, "weight_decay": 0.0}]


TORCH_CASES = {
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=0.01, betas=(0.8, 0.99), weight_decay=0.1),
    "Adam-L2": lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.1),
    "SGD-nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True,
                                               weight_decay=0.01),
    "SGD": lambda ps: torch.optim.SGD(ps, lr=0.05),
    "RMSprop-centered-momentum": lambda ps: torch.optim.RMSprop(
        ps, lr=0.01, alpha=0.9, momentum=0.5, centered=True, weight_decay=0.01),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05, lr_decay=0.01,
                                              initial_accumulator_value=0.1),
}
# Without a fused kernel: the step says so (functopt.fast.FastPathWarning).
PURE_PATH = {"RMSprop-centered-momentum", "Adagrad"}


def _close(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


def _bitwise(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


# -- a torch.optim.Optimizer -----------------------------------------------------------


def test_translated_optimizer_has_torch_groups_and_is_a_torch_optimizer() -> None:
    model = _model()
    torch_opt = torch.optim.AdamW(_groups(model), lr=0.01, betas=(0.8, 0.99))
    opt = MixedPrecisionOptimizer(torch_opt, loss_scale=None)
    assert isinstance(opt, torch.optim.Optimizer)
    assert [type(g) for g in opt.param_groups] == [dict, dict]
    for ours, theirs in zip(opt.param_groups, torch_opt.param_groups, strict=True):
        for key in ("lr", "betas", "eps", "weight_decay"):
            assert ours[key] == theirs[key], key
        assert all(p is q for p, q in zip(ours["params"], theirs["params"], strict=True))
    with pytest.raises(TypeError, match=r"add_param_group: the param groups are fixed"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(1))]})


@pytest.mark.parametrize("case", sorted(TORCH_CASES))
def test_translated_torch_optimizer_equals_torch_with_a_scheduler(case: str) -> None:
    """LightRFT's form, MixedPrecisionOptimizer(torch.optim.X(...)), against torch.optim.X
    driven by the same LambdaLR, in float64 (12 steps, two groups)."""
    model, ref = _model(), _model()
    opt = MixedPrecisionOptimizer(TORCH_CASES[case](_groups(model)), loss_scale=None,
                                  fused=case not in PURE_PATH)
    ref_opt = TORCH_CASES[case](_groups(ref))
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda t: 1.0 / (1 + t)) for o in
              (opt, ref_opt)]
    for t in range(12):
        for m, o in ((model, opt), (ref, ref_opt)):
            _loss(m, t).backward()
            o.step()
            o.zero_grad()
        for s in scheds:
            s.step()
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] < 0.01
    _close(model, ref)


def test_megatron_scheduler_writes_lr_and_weight_decay() -> None:
    """Megatron's OptimizerParamScheduler writes group['lr'] and group['weight_decay'] at
    every step; the facade follows them as torch.optim.AdamW does (cosine, growing wd)."""
    model, ref = _model(), _model()
    opt = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01),
                                  loss_scale=None)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    for t in range(10):
        for o in (opt, ref_opt):
            for group in o.param_groups:
                group["lr"] = 0.01 * 0.5 * (1 + math.cos(math.pi * t / 10))
                group["weight_decay"] = 0.01 + 0.01 * t
        for m, o in ((model, opt), (ref, ref_opt)):
            _loss(m, t).backward()
            o.step()
            o.zero_grad()
    _close(model, ref)


def test_cosine_annealing_drives_an_injected_transform_and_a_factory() -> None:
    """The group's 'lr' reaches the step whether the transform injects it (written into
    the state) or a factory builds it (rebuilt): both equal torch.optim.SGD."""
    ref = _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    models = [_model(), _model()]
    opts = [
        MixedPrecisionOptimizer(models[0].named_parameters(), functopt.inject_hyperparams(
            functopt.sgd)(learning_rate=0.1, momentum=0.9), loss_scale=None),
        MixedPrecisionOptimizer(models[1].named_parameters(),
                                lambda learning_rate=0.1: functopt.sgd(learning_rate, 0.9),
                                loss_scale=None),
    ]
    scheds = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=8)
              for o in (ref_opt, *opts)]
    for t in range(8):
        for m, o in ((ref, ref_opt), *zip(models, opts, strict=True)):
            _loss(m, t).backward()
            o.step()
            o.zero_grad()
        for s in scheds:
            s.step()
    for m in models:
        _close(m, ref)


@settings(max_examples=20, deadline=None)
@given(lrs=st.lists(st.floats(0.0, 0.5), min_size=1, max_size=6),
       wds=st.lists(st.floats(0.0, 0.2), min_size=6, max_size=6),
       momentum=st.sampled_from([0.0, 0.9]))
def test_any_written_lr_and_weight_decay_sequence_equals_torch_sgd(lrs, wds, momentum) -> None:
    model, ref = _model(), _model()
    opt = MixedPrecisionOptimizer(torch.optim.SGD(_groups(model), lr=0.1, momentum=momentum),
                                  loss_scale=None)
    ref_opt = torch.optim.SGD(_groups(ref), lr=0.1, momentum=momentum)
    for t, lr in enumerate(lrs):
        for o in (opt, ref_opt):
            o.param_groups[1]["lr"] = lr
            o.param_groups[0]["weight_decay"] = wds[t]
        for m, o in ((model, opt), (ref, ref_opt)):
            _loss(m, t).backward()
            o.step()
            o.zero_grad()
    _close(model, ref)


def test_a_deep_copy_keeps_the_state_and_steps_alike() -> None:
    model = _model(torch.bfloat16)
    opt = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    opt.backward(_loss(model, 0))
    assert opt.step()
    twin = copy.deepcopy(opt)  # torch.optim's __getstate__ alone would drop the state
    params = [p for g in twin.param_groups for p in g["params"]]
    for p, q in zip(model.parameters(), params, strict=True):
        q.grad = p.grad.clone()
    for o in (opt, twin):
        o.param_groups[0]["lr"] = 5e-3
        assert o.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params, strict=True))
    assert not any(p is q for p, q in zip(model.parameters(), params, strict=True))


def test_a_written_lr_is_used_by_the_next_step_exactly() -> None:
    w = torch.nn.Parameter(torch.zeros(2, dtype=F64))
    opt = MixedPrecisionOptimizer([("w", w)], functopt.inject_hyperparams(functopt.sgd)(
        learning_rate=1.0), loss_scale=None)
    assert opt.param_groups[0]["lr"] == 1.0
    opt.param_groups[0]["lr"] = 0.25
    w.grad = torch.tensor([1.0, -2.0], dtype=F64)
    assert opt.step()
    assert w.tolist() == [-0.25, 0.5]



def test_group_values_edited_in_place_reach_the_next_step() -> None:
    # A step whose groups hold the very values of the last one skips reading them, unless
    # a value can change in place: a tensor or a list. (A written lr is the step's own: the
    # group's lr_mult was folded into its lr at construction, not into what is written.)
    w = torch.nn.Parameter(torch.zeros(2, dtype=F64))
    opt = MixedPrecisionOptimizer(
        [{"params": [("w", w)], "lr_mult": 2.0}],
        lambda learning_rate=1.0: functopt.inject_hyperparams(functopt.sgd)(
            learning_rate=learning_rate), loss_scale=None)
    lr = torch.tensor(1.0, dtype=F64)
    opt.param_groups[0]["lr"] = lr
    for expected in ([-1.0, 2.0], [-1.25, 2.5], [-1.5, 3.0]):
        w.grad = torch.tensor([1.0, -2.0], dtype=F64)
        assert opt.step()
        assert w.tolist() == expected
        lr.fill_(0.25)  # the next step reads 0.25
    model, reference = _model(), _model()
    opt = MixedPrecisionOptimizer(model.parameters(), functopt.inject_hyperparams(
        functopt.adam)(learning_rate=0.01), loss_scale=None)
    torch_opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    betas = [0.9, 0.999]
    opt.param_groups[0]["betas"] = betas
    for step in range(3):
        for m, o in ((model, opt), (reference, torch_opt)):
            o.zero_grad()
            _loss(m, step).backward()
            o.step()
        _close(model, reference)
        betas[0] = torch_opt.param_groups[0]["betas"][0] / 2  # in place, for both
        torch_opt.param_groups[0]["betas"] = (betas[0], 0.999)


def test_group_keys_no_transform_reads_are_refused() -> None:
    model = _model()
    opt = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters()), loss_scale=None)
    opt.param_groups[0]["initial_lr"] = 0.001  # a scheduler's record: kept, not read
    opt.param_groups[0]["momentum"] = 0.9
    _loss(model, 0).backward()
    with pytest.raises(ValueError, match=r"param_groups\[0\] sets 'momentum', but the "
                                         r"transform has no hyperparameter for it .* \(its groups "
                                         r"hold the transform's hyperparameters \['amsgrad', "
                                         r"'betas', 'decoupled_weight_decay', 'eps', 'lr', "
                                         r"'maximize', 'weight_decay'\],"):
        opt.step()
    with pytest.raises(ValueError, match=r"sets \['foo'\], which the translation"):
        MixedPrecisionOptimizer(torch.optim.SGD([{"params": model.parameters(), "foo": 1}],
                                                lr=0.1))
    with pytest.raises(ValueError, match=r"sets 'lr', but the transform has no "
                                         r"hyperparameter for it"):
        MixedPrecisionOptimizer([{"params": model.parameters(), "lr": 0.1}],
                                functopt.inject_hyperparams(functopt.scale_by_adam)())


def test_a_group_edit_that_changes_the_state_layout_is_refused() -> None:
    model = _model()
    opt = MixedPrecisionOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                  loss_scale=None)
    _loss(model, 0).backward()
    assert opt.step()
    opt.param_groups[0]["amsgrad"] = True
    with pytest.raises(ValueError, match=r"new values of \[\"param_groups\[0\]\['amsgrad'\]\"\] "
                                         r"change the layout of the transform's state"):
        opt.step()
    opt.param_groups[0]["amsgrad"] = False  # as it was: steps again
    assert opt.step()


def test_a_group_edit_within_the_layout_rebuilds_and_equals_torch() -> None:
    """nesterov switched on after 3 steps (same momentum buffer), as in torch.optim.SGD."""
    model, ref = _model(), _model()
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                  loss_scale=None)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for t in range(6):
        if t == 3:
            opt.param_groups[0]["nesterov"] = ref_opt.param_groups[0]["nesterov"] = True
        for m, o in ((model, opt), (ref, ref_opt)):
            _loss(m, t).backward()
            o.step()
            o.zero_grad()
    _close(model, ref)


@pytest.mark.parametrize("case", list(TORCH_CASES))
def test_a_functopt_optim_optimizer_is_translated_as_torchs(case: str) -> None:
    # functopt.optim's classes make their state at construction: not stepped yet, so the
    # facade takes them, and steps them bitwise as the torch class of the same name
    def swapped(ps: list[dict]) -> torch.optim.Optimizer:
        made = TORCH_CASES[case](ps)
        return getattr(functopt.optim, type(made).__name__)(
            ps, **{k: v for k, v in made.defaults.items() if k in {
                "lr", "betas", "weight_decay", "momentum", "nesterov", "alpha", "centered",
                "lr_decay", "initial_accumulator_value"}})

    models = []
    for make in (TORCH_CASES[case], swapped):
        model = _model()
        opt = MixedPrecisionOptimizer(make(_groups(model)), loss_scale=None,
                                      fused=case not in PURE_PATH)
        for t in range(4):
            _loss(model, t).backward()
            opt.step()
            opt.zero_grad()
        models.append(model)
    assert _bitwise(*models)
    assert not _bitwise(models[0], _model())
    stepped = swapped(_groups(model := _model()))
    _loss(model, 0).backward()
    stepped.step()
    with pytest.raises(ValueError, match=r"optimizer has state \(it has stepped\)"):
        MixedPrecisionOptimizer(stepped)


def test_translation_refuses_what_it_cannot_translate() -> None:
    model = _model()
    with pytest.raises(TypeError, match=r"cannot translate torch.optim.adamax.Adamax"):
        MixedPrecisionOptimizer(torch.optim.Adamax(model.parameters()))
    stepped = torch.optim.AdamW(model.parameters())
    _loss(model, 0).backward()
    stepped.step()
    with pytest.raises(ValueError, match=r"AdamW optimizer has state \(it has stepped\)"):
        MixedPrecisionOptimizer(stepped)
    with pytest.raises(TypeError, match=r"got a SGD optimizer and a transform"):
        MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                functopt.sgd(0.1))
    with pytest.raises(TypeError, match=r"expected a transform after the params"):
        MixedPrecisionOptimizer(model.parameters())


def test_checkpoint_with_a_scheduler_continues_bitwise() -> None:
    """Saved between optimizer.step() and scheduler.step() (as Lightning saves): the
    restored pair continues bitwise, the group lr included."""
    def build(model):
        opt = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    model = _model(torch.bfloat16)
    opt, sched = build(model)
    for t in range(5):
        opt.backward(_loss(model, t))
        opt.step()
        opt.zero_grad()
        sched.step()
    saved = copy.deepcopy({"opt": opt.state_dict(), "sched": sched.state_dict(),
                           "model": model.state_dict()})
    twin = _model(torch.bfloat16, seed=3)
    twin.load_state_dict(saved["model"])
    opt2, sched2 = build(twin)
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 0.0025
    for t in range(5, 10):
        for m, o, s in ((model, opt, sched), (twin, opt2, sched2)):
            o.backward(_loss(m, t))
            o.step()
            o.zero_grad()
            s.step()
    assert _bitwise(model, twin)


# -- Megatron-LM's surface -----------------------------------------------------------------


def _unscaled_norm(model: torch.nn.Module, step: int) -> float:
    ref = copy.deepcopy(model)
    _loss(ref, step).backward()
    return float(torch.linalg.vector_norm(torch.cat([p.grad.double().reshape(-1)
                                                     for p in ref.parameters()])))


def test_get_grad_norm_is_the_norm_of_the_current_gradients() -> None:
    model = _model(torch.float32)
    opt = MixedPrecisionOptimizer(model.named_parameters(), functopt.adamw(1e-2))
    expected = _unscaled_norm(model, 0)
    opt.backward(_loss(model, 0))  # scaled by 65536
    before = opt.get_grad_norm()
    assert before.dtype == torch.float32
    assert before.item() == pytest.approx(expected, rel=1e-6)
    assert opt.step()
    assert opt.get_grad_norm() is opt._state.metrics.grad_norm  # no second pass
    model[0].weight.grad.mul_(2.0)  # changed since the step: computed again
    assert opt.get_grad_norm().item() > expected


def test_grad_norm_skip_threshold_skips_like_an_overflow_without_a_trace() -> None:
    model = _model(torch.bfloat16)
    opt = MixedPrecisionOptimizer(model.named_parameters(), functopt.adamw(1e-2),
                                  return_grad_stats=True, count_zeros=True)
    opt.backward(_loss(model, 0))
    assert opt.step()[0]
    opt.zero_grad()
    norm = _unscaled_norm(model, 1)
    opt.grad_norm_skip_threshold = norm / 2
    before = copy.deepcopy(_state_dict.to_nested("test", opt._state))
    params = [p.detach().clone() for p in model.parameters()]
    opt.backward(_loss(model, 1))
    ok, grad_norm, zeros = opt.step()
    assert ok is False and grad_norm == pytest.approx(norm, rel=1e-2) and zeros == 0
    after = _state_dict.to_nested("test", opt._state)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params, strict=True))
    for part in ("master", "inner_state"):
        assert str(after[part]) == str(before[part])
    assert after["metrics"]["skipped_steps"].item() == 1
    assert after["loss_scale"]["growth_tracker"].item() == 2  # counted as a finite step
    opt.grad_norm_skip_threshold = math.inf
    assert opt.step()[0]
    with pytest.raises(ValueError, match=r"grad_norm_skip_threshold must be a Python number"):
        opt.grad_norm_skip_threshold = 0.0


def test_a_state_dict_taken_before_a_threshold_skip_keeps_its_values() -> None:
    model = _model(torch.bfloat16)
    opt = MixedPrecisionOptimizer(model.named_parameters(), functopt.adamw(1e-2),
                                  grad_norm_skip_threshold=1e-9)
    held = opt.state_dict()
    values = copy.deepcopy(held)
    opt.backward(_loss(model, 0))
    assert not opt.step()  # skipped for the threshold
    opt.grad_norm_skip_threshold = math.inf
    assert opt.step()  # must not update the held tensors in place
    assert all(torch.equal(held["state"][k]["master"], values["state"][k]["master"])
               for k in values["state"])


def test_step_result_triple_on_overflow_and_without_zero_counting() -> None:
    w = torch.nn.Parameter(torch.zeros(3))
    opt = MixedPrecisionOptimizer([("w", w)], functopt.sgd(0.1), return_grad_stats=True,
                                  count_zeros=False)
    w.grad = torch.tensor([3.0, 4.0, 0.0]) * 65536
    assert opt.step() == (True, 5.0, None)
    w.grad = torch.tensor([math.inf, 0.0, 0.0])
    assert opt.step() == (False, None, None)


def test_clip_grad_norm_megatron_form_clips_now_and_returns_the_norm() -> None:
    w = torch.nn.Parameter(torch.zeros(2))
    opt = MixedPrecisionOptimizer([("w", w)], functopt.sgd(1.0))
    w.grad = torch.tensor([3.0, 4.0]) * 65536
    assert opt.clip_grad_norm(1.0) == 5.0
    coeff = 1.0 / (5.0 + 1e-6)  # Megatron's clip_grad_by_total_norm_fp32
    torch.testing.assert_close(w.grad, torch.tensor([3.0, 4.0]) * 65536 * coeff)
    clipped = w.grad.clone()
    assert opt.clip_grad_norm(clip_grad=10.0) == pytest.approx(5.0 * coeff, rel=1e-6)
    assert torch.equal(w.grad, clipped)  # below the bound: left alone
    assert opt.clip_grad_norm(None, 2.0) is None  # LightRFT's form: a setting for steps
    assert "max_grad_norm=2.0" in repr(opt)
    with pytest.raises(ValueError, match=r"clip_grad must be a finite Python number >= 0"):
        opt.clip_grad_norm(-1.0)


def test_reload_model_params_from_a_float32_state_dict() -> None:
    model = _model(torch.bfloat16)
    opt = MixedPrecisionOptimizer(model.named_parameters(), functopt.adamw(1e-2))
    full = {n: torch.randn(p.shape, dtype=torch.float32) for n, p in model.named_parameters()}
    opt.reload_model_params({**full, "buffer": torch.zeros(1)})
    master = opt._state.master
    for name, p in model.named_parameters():
        assert torch.equal(master[name], full[name])  # no rounding through bfloat16
        assert torch.equal(p, full[name].to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"has no entry for the params \['2.bias'\]"):
        opt.reload_model_params({k: v for k, v in full.items() if k != "2.bias"})


def test_main_grad_is_read_where_a_param_has_one() -> None:
    """Megatron accumulates into float32 .main_grad (here beside an ignored .grad)."""
    models = [_model(torch.bfloat16), _model(torch.bfloat16)]
    opts = [MixedPrecisionOptimizer(m.named_parameters(), functopt.adamw(1e-2),
                                    loss_scale=None) for m in models]
    _loss(models[0], 0).backward()
    for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True):
        q.main_grad = p.grad.float()
        q.grad = torch.full_like(q, 100.0)
    for opt in opts:
        assert opt.step()
    assert _bitwise(*models)
    opts[1].zero_grad()
    assert all(torch.all(q.main_grad == 0) and q.grad is None
               for q in models[1].parameters())


# -- schedule-free: train() / eval() ---------------------------------------------------------


def test_schedule_free_eval_train_equals_functopt_optimizer_and_resumes_bitwise() -> None:
    tx = contrib.schedule_free_adamw(0.05, warmup_steps=2)
    model, ref, straight = _model(torch.float32), _model(torch.float32), _model(torch.float32)
    opt = MixedPrecisionOptimizer(model.named_parameters(), tx, loss_scale=None, fused=False)
    # (unnamed: functopt.Optimizer.eval pairs a named group's params with the sorted names)
    ref_opt = functopt.Optimizer(ref.parameters(), tx, fused=False)
    straight_opt = MixedPrecisionOptimizer(straight.named_parameters(), tx, loss_scale=None,
                                           fused=False)
    for t in range(4):
        for m, o in ((model, opt), (ref, ref_opt), (straight, straight_opt)):
            _loss(m, t).backward()
            o.step()
            o.zero_grad()
    opt.eval()
    ref_opt.eval()
    assert _bitwise(model, ref) and not _bitwise(model, straight)
    with pytest.raises(RuntimeError, match=r"step: the params hold the schedule-free "
                                           r"evaluation point"):
        opt.step()
    saved = copy.deepcopy(opt.state_dict())  # taken in eval mode
    opt.train()
    assert _bitwise(model, straight)
    twin = copy.deepcopy(straight)
    twin_opt = MixedPrecisionOptimizer(twin.named_parameters(), tx, loss_scale=None,
                                       fused=False)
    twin_opt.load_state_dict(saved)
    for t in range(4, 7):
        for m, o in ((model, opt), (straight, straight_opt), (twin, twin_opt)):
            _loss(m, t).backward()
            o.step()
            o.zero_grad()
    assert _bitwise(model, straight) and _bitwise(twin, straight)
    with pytest.raises(TypeError, match=r"^MixedPrecisionOptimizer.eval: param_groups\[0\]'s "
                                        r"transform has 0 schedule_free stages"):
        MixedPrecisionOptimizer(model.named_parameters(), functopt.sgd(0.1)).eval()


def _trained(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    for t in range(3):
        _loss(model, t).backward()
        opt.step()
        opt.zero_grad()


def test_schedule_free_eval_moves_each_group_by_its_own_stage() -> None:
    """Two groups, each its own schedule_free state (a factory: one transform per group,
    through partition): each param moves to x = (y - (1 - b1) z) / b1 of its group's state
    (y its master). Two groups sharing one state (a fixed transform) move as one group."""
    model = _model(torch.bfloat16)
    opt = MixedPrecisionOptimizer(
        [{"params": _groups(model)[0]["params"]},
         {"params": _groups(model)[1]["params"], "learning_rate": 0.02}],
        lambda learning_rate=0.05: contrib.schedule_free_adamw(learning_rate),
        loss_scale=None, fused=False)
    _trained(model, opt)
    states = _state_dict.to_nested("test", opt._state)["inner_state"]["inner_states"]
    want = []
    for i, group in enumerate(opt.param_groups):
        stage = states[str(i)]
        b1 = stage["b1"].double()
        assert float(b1) < 1.0
        for name in group["param_names"]:
            y, z = opt._state.master[name].double(), stage["z"][name].double()
            want.append(((y - (1 - b1) * z) / b1).float().to(torch.bfloat16))
    before = [p.detach().clone() for p in model.parameters()]
    opt.eval()
    moved = [p for group in opt.param_groups for p in group["params"]]
    assert all(torch.equal(p, x) for p, x in zip(moved, want, strict=True))
    assert not any(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    tx = contrib.schedule_free_adamw(0.05)
    shared, single = _model(torch.float32), _model(torch.float32)
    shared_opt = MixedPrecisionOptimizer(
        [{"params": group["params"]} for group in _groups(shared)], tx, loss_scale=None,
        fused=False)
    single_opt = MixedPrecisionOptimizer(
        [p for group in _groups(single) for p in group["params"]], tx, loss_scale=None,
        fused=False)
    _trained(shared, shared_opt)
    _trained(single, single_opt)
    before = [p.detach().clone() for p in shared.parameters()]
    shared_opt.eval()
    single_opt.eval()
    assert _bitwise(shared, single)  # the shared stage moved each param once
    assert not any(torch.equal(p, b) for p, b in zip(shared.parameters(), before, strict=True))


def test_schedule_free_eval_refuses_a_group_without_a_stage_and_moves_nothing() -> None:
    model = _model(torch.float32)
    opt = MixedPrecisionOptimizer(
        [{"params": _groups(model)[0]["params"]},
         {"params": _groups(model)[1]["params"], "free": False}],
        lambda free=True: contrib.schedule_free_sgd(0.1) if free else functopt.sgd(0.1),
        loss_scale=None, fused=False)
    _trained(model, opt)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TypeError, match=r"^MixedPrecisionOptimizer.eval: param_groups\[1\]'s "
                                        r"transform has 0 schedule_free stages"):
        opt.eval()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    _loss(model, 3).backward()
    assert opt.step()  # still in train mode


def test_a_copy_made_in_eval_mode_is_in_eval_mode_and_trains_from_its_own_params() -> None:
    for make in (lambda m: MixedPrecisionOptimizer(m.named_parameters(),
                                                   contrib.schedule_free_sgd(0.1),
                                                   loss_scale=None, fused=False),
                 lambda m: functopt.Optimizer(m.parameters(), contrib.schedule_free_sgd(0.1),
                                              fused=False)):
        model = _model(torch.float32)
        opt = make(model)
        _trained(model, opt)
        train_params = [p.detach().clone() for p in model.parameters()]
        opt.eval()
        twin_model, twin = copy.deepcopy((model, opt))
        with pytest.raises(RuntimeError, match=r"step: the params hold the schedule-free"):
            twin.step()
        twin.train()
        assert all(torch.equal(p, q) for p, q in zip(twin_model.parameters(), train_params,
                                                     strict=True))
        assert not _bitwise(model, twin_model)  # the original is still at x
        with pytest.raises(RuntimeError, match=r"load_state_dict: the params hold the "
                                               r"schedule-free evaluation point"):
            opt.load_state_dict(twin.state_dict())
        opt.train()
        assert _bitwise(model, twin_model)


def test_schedule_free_eval_of_a_bfloat16_model_uses_the_masters() -> None:
    model = _model(torch.bfloat16)
    opt = MixedPrecisionOptimizer(model.named_parameters(), contrib.schedule_free_sgd(0.1),
                                  loss_scale=None, fused=False)
    for t in range(3):
        _loss(model, t).backward()
        opt.step()
        opt.zero_grad()
    state = _state_dict.to_nested("test", opt._state)
    train_params = [p.detach().clone() for p in model.parameters()]
    opt.eval()
    b1 = state["inner_state"]["b1"].double()
    for name, p in model.named_parameters():
        y, z = state["master"][name].double(), state["inner_state"]["z"][name].double()
        assert torch.equal(p, ((y - (1 - b1) * z) / b1).float().to(torch.bfloat16))
    opt.train()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), train_params,
                                                 strict=True))
