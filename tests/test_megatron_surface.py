"""Megatron-LM's optimizer calls on ``MixedPrecisionOptimizer`` (functopt/adapters/_megatron.py).

Held to megatron-core 0.16.1 where its code runs on the CPU: its ``MegatronOptimizer``
methods called on the facade (``scale_loss``' value), its ``_zero_grad_group_helper``
(``.decoupled_grad``), and a transcription of its ``MixedPrecisionOptimizer.step``
(``prepare_grads``, then ``step_with_ready_grads`` unless they overflowed) against the
facade's own ``step()``. The two-rank checks are in tests/distributed/agreement_checks.py.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import functopt

with warnings.catch_warnings():  # without Transformer Engine and Apex it says so
    warnings.simplefilter("ignore")
    from megatron.core.optimizer import optimizer as megatron_optimizer


def _model(dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 2)).to(dtype)


def _facade(model: torch.nn.Module, **options: Any) -> functopt.MixedPrecisionOptimizer:
    options.setdefault("loss_scale",
                       functopt.dynamic_loss_scale(init_scale=2.0**10, growth_interval=2))
    return functopt.MixedPrecisionOptimizer(
        model.named_parameters(), functopt.adamw(1e-2, weight_decay=0.1), **options)


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(8, 4, generator=g).to(next(model.parameters()).dtype)
    return model(x).float().pow(2).mean()


@pytest.mark.parametrize(("dtype", "shape"), [(torch.bfloat16, ()), (torch.bfloat16, (1,)),
                                              (torch.float32, (1,)), (torch.float16, ()),
                                              (torch.float64, ())])
def test_scale_loss_is_megatrons_value_in_the_losss_dtype(dtype: torch.dtype,
                                                          shape: tuple[int, ...]) -> None:
    opt = _facade(_model())
    loss = torch.full(shape, 0.75, dtype=dtype)
    got = opt.scale_loss(loss)
    theirs = megatron_optimizer.MegatronOptimizer.scale_loss(opt, loss)  # its code, our scale
    assert got.dtype == dtype and got.shape == loss.shape
    assert float(got.sum()) == float(theirs.sum()) == 0.75 * 2.0**10


def test_scale_loss_gradients_are_the_scaled_ones_backward_makes() -> None:
    """What the schedules do with it (backward on the scaled loss) leaves the gradients
    ``backward(loss)`` leaves."""
    ours, ref = _model(), _model()
    a, b = _facade(ours), _facade(ref)
    torch.autograd.backward(a.scale_loss(_loss(ours, 0)))
    b.backward(_loss(ref, 0))
    for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert torch.equal(p.grad, q.grad)
        assert float(p.grad.abs().max()) > 0


@pytest.mark.parametrize("bad", [[torch.tensor(1.0)], 1.0, torch.tensor(3)])
def test_scale_loss_refuses_what_is_not_a_floating_tensor(bad: Any) -> None:
    with pytest.raises(TypeError, match=r"MixedPrecisionOptimizer\.scale_loss: loss must be"):
        _facade(_model()).scale_loss(bad)


def test_get_parameters_is_the_stepped_params_in_group_order() -> None:
    model = _model()
    opt = functopt.MixedPrecisionOptimizer(
        [{"params": model[0].named_parameters(prefix="0"), "frozen": True},
         {"params": [("2.bias", model[2].bias)], "weight_decay": 0.0},
         {"params": [("2.weight", model[2].weight)]}],
        lambda weight_decay=0.1: functopt.adamw(1e-2, weight_decay=weight_decay))
    got = opt.get_parameters()
    assert [id(p) for p in got] == [id(model[2].bias), id(model[2].weight)]


def test_main_grads_for_grad_norm_are_the_unscaled_gradients_of_the_norm() -> None:
    model = _model()
    opt = _facade(model)
    opt.backward(_loss(model, 0))
    model[0].weight.main_grad = model[0].weight.grad.float() * 0.5  # read instead of .grad
    grads = opt.get_main_grads_for_grad_norm()
    scale = opt.loss_scale
    expected = [model[0].weight.main_grad / scale] + [
        p.grad.float() / scale for n, p in model.named_parameters() if n != "0.weight"]
    assert len(grads) == len(expected) == 4
    for got, want in zip(grads, expected, strict=True):
        assert got.dtype == torch.float32
        assert torch.equal(got, want)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    torch.testing.assert_close(norm, opt.get_grad_norm(), rtol=1e-6, atol=0.0)


def test_a_single_process_has_no_grad_stats_group() -> None:
    with pytest.raises(ValueError, match="summed over no process group"):
        _facade(_model()).get_grad_stats_parallel_group()


def _megatron_step(opt: functopt.MixedPrecisionOptimizer) -> tuple[bool, bool, float]:
    """megatron-core 0.16.1's ``MixedPrecisionOptimizer.step``, transcribed (no clip,
    ``clip_grad`` 0; no zero count): ``(found_inf, success, loss scale after
    prepare_grads)``."""
    found = opt.prepare_grads()
    scale = opt.loss_scale
    if found:
        return True, False, scale
    return False, opt.step_with_ready_grads(), scale


def test_prepare_and_step_with_ready_grads_are_the_step() -> None:
    """Megatron's two halves over steps with an overflow among them give the facade's
    ``step()`` bitwise: params, loss scale and each step's verdict."""
    ours, ref = _model(), _model()
    a, b = _facade(ours), _facade(ref)
    for step in range(6):
        for model, opt in ((ours, a), (ref, b)):
            opt.backward(_loss(model, step))
            if step == 2:
                model[2].weight.grad[0, 0] = float("inf")
        before = [p.detach().clone() for p in ours.parameters()]
        scale_before = a.loss_scale
        found, took, prepared_scale = _megatron_step(a)
        assert found == (step == 2)
        assert took == b.step() == (step != 2)
        # the overflow's back-off happens in prepare_grads, as Megatron's scaler update
        assert (prepared_scale == scale_before / 2) == found
        assert a.loss_scale == b.loss_scale
        for p, q, old in zip(ours.parameters(), ref.parameters(), before, strict=True):
            assert torch.equal(p, q)
            assert torch.equal(p, old) == (step == 2)
        a.zero_grad()
        b.zero_grad()
    assert a.loss_scale != 2.0**10  # the scale moved: backed off, grew


def test_prepare_grads_on_finite_gradients_changes_nothing() -> None:
    model = _model()
    opt = _facade(model)
    opt.backward(_loss(model, 0))
    before = [p.detach().clone() for p in model.parameters()]
    state = opt.state_dict()
    assert opt.prepare_grads() is False
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    after = opt.state_dict()
    assert after["state"].keys() == state["state"].keys()
    for k, entry in state["state"].items():
        for name, value in entry.items():
            other = after["state"][k][name]
            assert (torch.equal(value, other) if isinstance(value, torch.Tensor)
                    else value == other), name


def test_a_decoupled_grad_is_read_and_cleared_as_megatrons() -> None:
    """A param's ``.decoupled_grad`` (Megatron's precision-aware optimizer) is the gradient
    the step reads, before ``.main_grad`` and ``.grad``; ``zero_grad`` leaves it as
    megatron-core's ``_zero_grad_group_helper(use_decoupled_grad=True)`` does."""
    ours, ref = _model(), _model()
    a, b = _facade(ours, loss_scale=None), _facade(ref, loss_scale=None)
    b.backward(_loss(ref, 0))
    for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
        p.decoupled_grad = q.grad.clone()
        p.grad = torch.full_like(p, float("nan"))  # not read
    assert a.step() and b.step()
    assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), ref.parameters(),
                                                   strict=True))
    for set_to_none in (False, True):
        mine = [torch.nn.Parameter(torch.ones(2)) for _ in range(2)]
        theirs = [torch.nn.Parameter(torch.ones(2)) for _ in range(2)]
        for p in mine + theirs:
            p.decoupled_grad = torch.full((2,), 3.0)
        opt = functopt.MixedPrecisionOptimizer(mine, functopt.sgd(0.1), loss_scale=None)
        opt.zero_grad(set_to_none=set_to_none)
        megatron_optimizer._zero_grad_group_helper(theirs, set_to_none,
                                                   use_decoupled_grad=True)
        for p, q in zip(mine, theirs, strict=True):
            assert (p.decoupled_grad is None) == (q.decoupled_grad is None) == set_to_none
            if not set_to_none:
                assert torch.equal(p.decoupled_grad, q.decoupled_grad)
                assert not p.decoupled_grad.any()


# ----------------------------------------------------- from_optimizer_config (0.16.1)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core import optimizer as megatron
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


def _megatron_groups(model: torch.nn.Module, config: Any,
                     overrides: Any = None) -> list[dict[str, Any]]:
    """megatron-core's own ``_get_param_groups`` (it all-gathers the group keys: one rank)."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return megatron._get_param_groups([model], config, overrides)
    finally:
        dist.destroy_process_group()


def _transformer_like(dtype: torch.dtype = torch.bfloat16) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8),
                               torch.nn.Linear(8, 2)).to(dtype)


def test_from_optimizer_config_groups_are_megatrons() -> None:
    config = megatron.OptimizerConfig(lr=1e-3, min_lr=1e-5, bf16=True, weight_decay=0.1)
    model = _transformer_like()
    theirs = _megatron_groups(model, config)
    opt = functopt.MixedPrecisionOptimizer.from_optimizer_config(config, model)
    assert len(opt.param_groups) == len(theirs) == 2
    keys = ("wd_mult", "lr_mult", "is_decoupled_lr", "max_lr", "min_lr",
            "is_expert_parallel", "default_config")
    for ours, ref in zip(opt.param_groups, theirs, strict=True):
        assert [id(p) for p in ours["params"]] == [id(p) for p in ref["params"]]
        assert {k: ours.get(k, 1.0) for k in keys} == {k: ref[k] for k in keys}
        # the group holds the decay its step uses (Megatron's scheduler writes the same)
        assert ours["lr"] == 1e-3 and ours["weight_decay"] == 0.1 * ref["wd_mult"]
        assert ours["betas"] == (config.adam_beta1, config.adam_beta2)


def test_from_optimizer_config_steps_as_megatrons_loop() -> None:
    """Megatron's loop: its ``OptimizerParamScheduler`` writing every group's lr and
    weight decay, the bf16 step of ``Float16OptimizerWithFloat16Params`` over
    ``torch.optim.AdamW`` (what megatron-core builds without Transformer Engine or Apex),
    transcribed: float32 main params, the norm and its clip ``clip_grad / (norm + 1e-6)``,
    the AdamW step, the copy into the bf16 params."""
    # (an eps near the clipped gradients' size, so that Adam's update sees the clip)
    config = megatron.OptimizerConfig(lr=1e-2, min_lr=1e-4, bf16=True, weight_decay=0.1,
                                      clip_grad=0.05, adam_eps=1e-2)
    ours, ref_model = _transformer_like(), _transformer_like()
    opt = functopt.MixedPrecisionOptimizer.from_optimizer_config(config, ours)
    groups = _megatron_groups(ref_model, config)
    mains = {id(p): p.detach().float().clone().requires_grad_() for p in ref_model.parameters()}
    ref = torch.optim.AdamW([{**g, "params": [mains[id(p)] for p in g["params"]]}
                             for g in groups], lr=config.lr, weight_decay=config.weight_decay,
                            betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps)

    def schedule(o: Any) -> OptimizerParamScheduler:
        return OptimizerParamScheduler(
            o, init_lr=0.0, max_lr=config.lr, min_lr=config.min_lr, lr_warmup_steps=2,
            lr_decay_steps=8, lr_decay_style="cosine", start_wd=0.1, end_wd=0.2,
            wd_incr_steps=8, wd_incr_style="linear")

    ours_schedule, ref_schedule = schedule(opt), schedule(ref)
    clipped = 0
    for step in range(6):
        for model in (ours, ref_model):
            _loss(model, step).backward()
        with torch.no_grad():
            for p in ref_model.parameters():
                mains[id(p)].grad = p.grad.float()
            norm = torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(m.grad) for m in mains.values()]))
            coeff = config.clip_grad / (float(norm) + 1e-6)
            if coeff < 1.0:
                clipped += 1
                for m in mains.values():
                    m.grad.mul_(coeff)
        ref.step()
        with torch.no_grad():
            for p in ref_model.parameters():
                p.copy_(mains[id(p)])
        ok, grad_norm, zeros = opt.step()
        assert ok and zeros is None
        assert grad_norm == pytest.approx(float(norm), rel=1e-6)
        for sched in (ours_schedule, ref_schedule):
            sched.step(1)
        opt.zero_grad()
        ref_model.zero_grad()
    masters = opt.named_state_dict()["state"]
    for (name, p), q in zip(ours.named_parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(masters[name]["master"], mains[id(q)].detach(),
                                   rtol=1e-5, atol=1e-7)
        p, q = p.detach().float(), q.detach().float()
        assert float((p - q).abs().max()) <= 2 ** -7 * float(q.abs().max())
    assert clipped == 6
    assert opt.param_groups[1]["weight_decay"] == 0.0  # the scheduler's wd * wd_mult


def test_from_optimizer_config_loss_scales_are_megatrons_scalers() -> None:
    model = _transformer_like(torch.float16)
    fp16 = megatron.OptimizerConfig(lr=1e-3, fp16=True, initial_loss_scale=2.0**10,
                                    min_loss_scale=256.0, loss_scale_window=2, hysteresis=2,
                                    clip_grad=0.0)
    opt = functopt.MixedPrecisionOptimizer.from_optimizer_config(fp16, model)
    seen = []
    for step, overflow in enumerate([True, True, False, False, True, True, True, True]):
        _loss(model, step).backward()
        if overflow:
            model[0].weight.grad[0, 0] = float("inf")
        opt.step()
        opt.zero_grad()
        seen.append(opt.loss_scale)
    # DynamicGradScaler: hysteresis 2 absorbs the first overflow after a growth, backs off at
    # the second; two finite steps grow (and reset the hysteresis); never below min_scale
    assert seen == [1024.0, 512.0, 512.0, 1024.0, 1024.0, 512.0, 256.0, 256.0]
    static = megatron.OptimizerConfig(lr=1e-3, fp16=True, loss_scale=128.0)
    assert functopt.MixedPrecisionOptimizer.from_optimizer_config(
        static, _transformer_like(torch.float16)).loss_scale == 128.0
    bf16 = megatron.OptimizerConfig(lr=1e-3, bf16=True)
    assert functopt.MixedPrecisionOptimizer.from_optimizer_config(
        bf16, _transformer_like()).loss_scale == 1.0


def _assert_steps_alike(opt: functopt.MixedPrecisionOptimizer, theirs: torch.optim.Optimizer,
                        ours: torch.nn.Module, ref: torch.nn.Module) -> None:
    """Three steps of each optimizer on its model's loss: the params agree to rounding."""
    for step in range(3):
        for model in (ours, ref):
            _loss(model, step).backward()
        result = opt.step()
        assert result[0] if isinstance(result, tuple) else result
        theirs.step()
        opt.zero_grad()
        theirs.zero_grad()
    for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_from_optimizer_config_sgd_is_torch_sgd() -> None:
    config = megatron.SGDOptimizerConfig(lr=0.1, sgd_momentum=0.5, weight_decay=0.0,
                                         clip_grad=0.0)
    ours, ref = _transformer_like(torch.float32), _transformer_like(torch.float32)
    opt = functopt.MixedPrecisionOptimizer.from_optimizer_config(config, ours)
    theirs = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.5)
    _assert_steps_alike(opt, theirs, ours, ref)


@pytest.mark.parametrize(("field", "value"), [
    ("use_distributed_optimizer", True), ("optimizer_cpu_offload", True),
    ("timers", print), ("optimizer", "muon")])
def test_from_optimizer_config_refuses_what_it_cannot_honour(field: str, value: Any) -> None:
    config = megatron.OptimizerConfig(lr=1e-3, bf16=True)
    setattr(config, field, value)  # (past __post_init__'s checks of other fields)
    with pytest.raises(ValueError, match=rf"config\.{field}="):
        functopt.MixedPrecisionOptimizer.from_optimizer_config(config, _transformer_like())


class _Attention(torch.nn.Module):
    """Names as Megatron's attention: q/k LayerNorms, an embedding and an output layer
    marked ``is_embedding_or_output_parameter``, an expert (``allreduce=False``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Embedding(6, 4)
        self.q_layernorm = torch.nn.LayerNorm(4)
        self.k_layernorm = torch.nn.LayerNorm(4)
        self.linear_qkv = torch.nn.Linear(4, 12)
        self.expert = torch.nn.Linear(4, 4)
        self.output_layer = torch.nn.Linear(4, 6, bias=False)
        for p in (self.embedding.weight, self.output_layer.weight):
            p.is_embedding_or_output_parameter = True
        for p in self.expert.parameters():
            p.allreduce = False


def _keys() -> dict[str, Any]:
    """Overrides by each kind of ParamKey, overlapping (the qkv bias matches two)."""
    return {
        megatron.ParamKey(name="*.bias"): {"wd_mult": 0.0},
        megatron.ParamKey(name="linear_qkv.*"): {"max_lr": 5e-3, "min_lr": 1e-5},
        megatron.ParamKey(attr="is_embedding_or_output_parameter"): {"lr_mult": 0.5},
        megatron.ParamKey(predicate=megatron.ParamPredicate(
            name="wide", fn=lambda p: p.ndim == 2 and p.shape[0] == 12)):
            {"start_wd": 0.01, "end_wd": 0.2},
        megatron.ParamKey(with_name_predicate=megatron.ParamWithNamePredicate(
            name="qk_norms", fn=lambda p, name: "layernorm" in name)): {},
    }


@pytest.mark.parametrize(("fields", "overrides"), [
    ({}, None),
    ({"apply_wd_to_qk_layernorm": True}, None),
    ({"decoupled_lr": 2e-2}, None),
    ({"decoupled_lr": 2e-2, "decoupled_min_lr": 1e-4, "apply_wd_to_qk_layernorm": True},
     None),
    ({}, {}),
    ({}, "keys"),
], ids=["standard", "qk-layernorm", "decoupled-lr", "decoupled-both", "empty", "keys"])
def test_from_optimizer_config_groups_by_overrides_as_megatron(fields: dict[str, Any],
                                                              overrides: Any) -> None:
    """megatron-core 0.16.1's ``_get_param_groups``, with its standard overrides and with
    ``config_overrides`` of every kind of key: the same groups, in the same order, with the
    same params and fields."""
    config = megatron.OptimizerConfig(lr=1e-3, min_lr=1e-5, bf16=True, **fields)
    overrides = _keys() if overrides == "keys" else overrides
    model = _Attention().to(torch.bfloat16)
    theirs = _megatron_groups(model, config, overrides)
    opt = functopt.MixedPrecisionOptimizer.from_optimizer_config(config, model, overrides)
    assert len(opt.param_groups) == len(theirs) >= 2
    for ours, ref in zip(opt.param_groups, theirs, strict=True):
        assert [id(p) for p in ours["params"]] == [id(p) for p in ref["params"]]
        # (multipliers of 1 are left out of the facade's groups; the scheduler reads
        # group.get("wd_mult", 1.0)). megatron-core keeps lr_mult as a record its
        # scheduler never reads; the facade folds it into the lrs the scheduler reads.
        lr_mult = ref["lr_mult"]
        assert {k: ours.get(k, 1.0) if k.endswith("_mult") else ours[k]
                for k in ref if k != "params"} == {
            k: v * lr_mult if k in ("max_lr", "min_lr") else v
            for k, v in ref.items() if k != "params"}
        assert ours["lr"] == 1e-3 * lr_mult
        assert ours["weight_decay"] == config.weight_decay * ref["wd_mult"]


def test_from_optimizer_config_refuses_overrides_it_cannot_honour() -> None:
    config = megatron.OptimizerConfig(lr=1e-3, bf16=True)
    both = {megatron.ParamKey(name="*.bias"): {"wd_mult": 0.0},
            megatron.ParamKey(name="linear_qkv.*"): {"wd_mult": 0.5}}
    with pytest.raises(ValueError, match="Conflicting overrides for wd_mult"):
        _megatron_groups(_Attention(), config, both)
    with pytest.raises(ValueError, match=r"'linear_qkv\.bias' matches overrides that set "
                                         r"wd_mult to 0\.0 and to 0\.5"):
        functopt.MixedPrecisionOptimizer.from_optimizer_config(config, _Attention(), both)
    with pytest.raises(TypeError, match="has no matches"):
        functopt.MixedPrecisionOptimizer.from_optimizer_config(
            config, _Attention(), {"*.bias": {"wd_mult": 0.0}})
    with pytest.raises(TypeError, match="without 'params'"):
        functopt.MixedPrecisionOptimizer.from_optimizer_config(
            config, _Attention(), {megatron.ParamKey(name="*.bias"): {"params": []}})
    with pytest.raises(ValueError, match="config_overrides group the params of modules"):
        functopt.MixedPrecisionOptimizer.from_optimizer_config(
            config, list(_Attention().parameters()), {})
    with pytest.raises(ValueError, match=r"sets \['optimizer'\], which the translation"):
        functopt.MixedPrecisionOptimizer.from_optimizer_config(
            config, _Attention(), {megatron.ParamKey(name="*.bias"): {"optimizer": "sgd"}})
    decoupled = megatron.OptimizerConfig(lr=1e-3, bf16=True, decoupled_lr=1e-2)
    with pytest.raises(ValueError, match="which config_overrides replaces"):
        functopt.MixedPrecisionOptimizer.from_optimizer_config(decoupled, _Attention(), {})


def test_from_optimizer_config_refuses_a_bad_config() -> None:
    with pytest.raises(ValueError, match=r"config\.lr is None"):
        functopt.MixedPrecisionOptimizer.from_optimizer_config(
            megatron.OptimizerConfig(bf16=True), _transformer_like())
    with pytest.raises(TypeError, match=r"must be a megatron\.core\.optimizer\.OptimizerConfig"):
        functopt.MixedPrecisionOptimizer.from_optimizer_config({"lr": 1e-3},
                                                               _transformer_like())


def test_torch_optimizer_groups_with_megatrons_multipliers_are_honoured() -> None:
    """``MixedPrecisionOptimizer(torch.optim.AdamW(groups with lr_mult / wd_mult))``: the
    facade multiplies them in, as torch.optim.AdamW with lr * lr_mult and weight decay
    * wd_mult steps."""
    ours, ref = _transformer_like(torch.float32), _transformer_like(torch.float32)
    opt = functopt.MixedPrecisionOptimizer(torch.optim.AdamW(
        [{"params": ours[0].parameters(), "lr_mult": 2.0},
         {"params": [*ours[1].parameters(), *ours[2].parameters()], "wd_mult": 0.0}],
        lr=1e-2, weight_decay=0.5), loss_scale=None)
    theirs = torch.optim.AdamW(
        [{"params": ref[0].parameters(), "lr": 2e-2},
         {"params": [*ref[1].parameters(), *ref[2].parameters()], "weight_decay": 0.0}],
        lr=1e-2, weight_decay=0.5)
    _assert_steps_alike(opt, theirs, ours, ref)


def test_groups_saved_in_another_order_load_by_their_params_names() -> None:
    """Megatron rebuilds its groups in an order of its own between runs: a checkpoint
    loads into groups listed in another order, each group taking the values and state of
    the saved group naming its params; the run continues bitwise."""
    def build(order: str) -> tuple[torch.nn.Sequential, functopt.MixedPrecisionOptimizer]:
        model = _transformer_like()
        groups = {"a": {"params": list(model[0].named_parameters(prefix="0")), "lr": 1e-2},
                  "b": {"params": list(model[2].named_parameters(prefix="2")), "lr": 3e-2,
                        "weight_decay": 0.0},
                  "c": {"params": list(model[1].named_parameters(prefix="1")), "lr": 2e-2}}
        return model, functopt.MixedPrecisionOptimizer(
            torch.optim.AdamW([groups[k] for k in order], weight_decay=0.1),
            loss_scale=functopt.dynamic_loss_scale(init_scale=2.0**10))

    first, opt = build("abc")
    for step in range(2):
        opt.backward(_loss(first, step))
        assert opt.step()
        opt.zero_grad()
    opt.param_groups[1]["lr"] = 5e-3  # group "b": a value only the checkpoint holds
    saved = opt.state_dict()
    second, resumed = build("cab")
    resumed.load_state_dict(saved)
    assert [g["lr"] for g in resumed.param_groups] == [2e-2, 1e-2, 5e-3]
    assert [g["weight_decay"] for g in resumed.param_groups] == [0.1, 0.1, 0.0]
    for p, q in zip(first.parameters(), second.parameters(), strict=True):
        assert torch.equal(p, q)  # set from the loaded masters
    for step in range(2, 4):
        for model, o in ((first, opt), (second, resumed)):
            o.backward(_loss(model, step))
            assert o.step()
            o.zero_grad()
        for p, q in zip(first.parameters(), second.parameters(), strict=True):
            assert torch.equal(p, q)
    _, other = build("abc")
    regrouped = opt.state_dict()
    regrouped["param_groups"][0]["param_names"] = ["0.weight", "2.bias"]
    with pytest.raises(ValueError, match=r"names its params"):
        other.load_state_dict(regrouped)


def test_megatron_groups_resume_from_a_checkpoint_of_another_group_order() -> None:
    """megatron-core's groups (wd_mult 0 and 0.5, a decoupled lr, an lr_mult) under its
    scheduler: a checkpoint loads into the same groups listed in reverse (as Megatron may
    rebuild them), each group taking the values and state of the saved group naming its
    params, and the run goes on bitwise as the uninterrupted one. A saved group's
    multipliers come with its values (their products), so loading into groups built with
    others is no change of multiplier."""
    config = megatron.OptimizerConfig(lr=1e-2, min_lr=1e-4, weight_decay=0.05, clip_grad=0.0)

    def build(reverse: bool, lr_mult: float = 2.0) -> tuple[torch.nn.Module, Any, Any]:
        model = _Attention()
        names = {id(p): n for n, p in model.named_parameters()}
        groups = [{**g, "params": [(names[id(p)], p) for p in g["params"]]} for g in
                  _megatron_groups(model, config, _overrides({"lr_mult": lr_mult}))]
        opt = functopt.MixedPrecisionOptimizer(torch.optim.AdamW(
            groups[::-1] if reverse else groups, lr=config.lr,
            weight_decay=config.weight_decay), loss_scale=None)
        return model, opt, OptimizerParamScheduler(
            opt, init_lr=1e-3, max_lr=config.lr, min_lr=config.min_lr, lr_warmup_steps=2,
            lr_decay_steps=8, lr_decay_style="cosine", start_wd=0.02, end_wd=0.1,
            wd_incr_steps=8, wd_incr_style="linear")

    def run(model: torch.nn.Module, opt: Any, sched: Any, steps: range) -> None:
        for step in steps:
            g = torch.Generator().manual_seed(step)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g)
            assert opt.step()
            sched.step(1)

    def by_name(opt: Any) -> dict[str, tuple[float, float, float]]:
        return {n: (g["lr"], g["weight_decay"], g.get("lr_mult", 1.0))
                for g in opt.param_groups for n in g["param_names"]}

    whole = build(reverse=False)
    run(*whole, range(6))
    first = build(reverse=False)
    run(*first, range(3))
    saved, sched_saved = first[1].state_dict(), first[2].state_dict()
    for lr_mult in (2.0, 1.0):  # (1.0: built with other multipliers than saved)
        resumed = build(reverse=True, lr_mult=lr_mult)
        resumed[0].load_state_dict(first[0].state_dict())  # (float32: the params are the
        resumed[1].load_state_dict(saved)                   # masters, loaded with the model)
        resumed[2].load_state_dict(sched_saved)
        assert by_name(resumed[1]) == by_name(first[1])
        run(*resumed, range(3, 6))
        for p, q in zip(whole[0].parameters(), resumed[0].parameters(), strict=True):
            assert torch.equal(p, q)
        assert by_name(resumed[1]) == by_name(whole[1])


def test_functopt_optimizer_groups_load_by_their_params_names_in_another_order() -> None:
    """functopt.Optimizer, the same law: groups listed in reverse take the saved values
    (the multipliers' products) and state of the saved group naming their params, and
    step bitwise as the optimizer that saved them."""
    def build(reverse: bool) -> tuple[torch.nn.Module, functopt.Optimizer]:
        model = _transformer_like(torch.float32)
        groups = [{"params": list(model[0].named_parameters(prefix="0")), "lr_mult": 2.0},
                  {"params": list(model[1].named_parameters(prefix="1")), "wd_mult": 0.0},
                  {"params": list(model[2].named_parameters(prefix="2")), "wd_mult": 0.5}]
        return model, functopt.Optimizer(groups[::-1] if reverse else groups,
                                         functopt.adamw(1e-2, weight_decay=0.1))

    (first, opt), (second, resumed) = build(reverse=False), build(reverse=True)
    for step in range(2):
        _loss(first, step).backward()
        opt.step()
        opt.zero_grad()
    second.load_state_dict(first.state_dict())
    resumed.load_state_dict(opt.state_dict())
    assert [(g["lr"], g["weight_decay"]) for g in resumed.param_groups] == [
        (1e-2, 0.05), (1e-2, 0.0), (2e-2, 0.1)]
    for step in range(2, 4):
        for model, o in ((first, opt), (second, resumed)):
            _loss(model, step).backward()
            o.step()
            o.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(first.parameters(), second.parameters(),
                                                 strict=True))


def _scheduled_lrs(opt: Any) -> list[list[float]]:
    """Each group's lr over seven steps of Megatron's scheduler: warmup to 1e-2, linear
    decay to 1e-3."""
    sched = OptimizerParamScheduler(
        opt, init_lr=0.0, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=2, lr_decay_steps=6,
        lr_decay_style="linear", start_wd=0.1, end_wd=0.1, wd_incr_steps=6,
        wd_incr_style="constant")
    seen = []
    for _ in range(7):
        sched.step(1)
        seen.append([g["lr"] for g in opt.param_groups])
    return seen


def test_a_decoupled_lr_group_peaks_at_it_under_megatrons_scheduler() -> None:
    """``is_decoupled_lr=True`` with ``decoupled_lr`` / ``decoupled_min_lr`` (on the factory
    path and the torch optimizer's): Megatron's ``OptimizerParamScheduler`` drives that
    group between them, the others between the scheduler's own bounds."""
    def groups(model: torch.nn.Module) -> list[dict[str, Any]]:
        return [{"params": list(model[0].named_parameters(prefix="0"))},
                {"params": list(model[2].named_parameters(prefix="2")),
                 "is_decoupled_lr": True, "decoupled_lr": 4e-2, "decoupled_min_lr": 2e-3}]

    model = _transformer_like()
    torch_path = functopt.MixedPrecisionOptimizer(torch.optim.AdamW(groups(model), lr=1e-2))
    model = _transformer_like()
    factory_path = functopt.MixedPrecisionOptimizer(
        groups(model), lambda learning_rate=1e-2: functopt.adamw(learning_rate))
    for opt in (torch_path, factory_path):
        assert opt.param_groups[1]["max_lr"] == 4e-2 and opt.param_groups[1]["min_lr"] == 2e-3
        seen = _scheduled_lrs(opt)
        assert max(lr for lr, _ in seen) == pytest.approx(1e-2)
        assert max(lr for _, lr in seen) == pytest.approx(4e-2)
        assert seen[-1] == pytest.approx([1e-3, 2e-3])


def test_decoupled_lr_without_its_flag_or_beside_another_max_lr_is_refused() -> None:
    model = _transformer_like()
    with pytest.raises(ValueError, match="not is_decoupled_lr=True"):
        functopt.MixedPrecisionOptimizer(torch.optim.AdamW(
            [{"params": model.parameters(), "decoupled_lr": 4e-2}], lr=1e-2))
    with pytest.raises(ValueError, match=r"decoupled_lr=0\.04 and max_lr=0\.01"):
        functopt.MixedPrecisionOptimizer(torch.optim.AdamW(
            [{"params": model.parameters(), "is_decoupled_lr": True, "decoupled_lr": 4e-2,
              "max_lr": 1e-2}], lr=1e-2))


_ADAPTERS = {
    "torch_optimizer": lambda groups: functopt.MixedPrecisionOptimizer(
        torch.optim.AdamW(groups, lr=1e-2)),
    "factory": lambda groups: functopt.MixedPrecisionOptimizer(
        groups, lambda learning_rate=1e-2: functopt.adamw(learning_rate)),
    "functopt.Optimizer": lambda groups: functopt.Optimizer(groups, functopt.adamw(1e-2)),
}


@pytest.mark.parametrize("adapter", sorted(_ADAPTERS))
def test_megatrons_group_flags_are_honoured_or_refused(adapter: str) -> None:
    """``is_decoupled_lr=True`` with the group's own ``max_lr`` / ``min_lr`` (the groups
    megatron-core's builders made before 0.16.1) peaks and ends at them under Megatron's
    scheduler; without a decoupled lr it would change nothing and raises; a flag that is
    not a bool raises."""
    build = _ADAPTERS[adapter]

    def groups(model: torch.nn.Module, **flags: Any) -> list[dict[str, Any]]:
        return [{"params": list(model[0].named_parameters(prefix="0"))},
                {"params": list(model[2].named_parameters(prefix="2")), **flags}]

    seen = _scheduled_lrs(build(groups(_transformer_like(torch.float32), is_decoupled_lr=True,
                                       max_lr=4e-2, min_lr=2e-3)))
    assert max(lr for _, lr in seen) == pytest.approx(4e-2)
    assert seen[-1] == pytest.approx([1e-3, 2e-3])
    with pytest.raises(ValueError, match=r"param_groups\[1\] sets is_decoupled_lr=True but "
                                         r"holds no decoupled learning rate.*Fix: give"):
        build(groups(_transformer_like(torch.float32), is_decoupled_lr=True))
    for key, value in (("is_decoupled_lr", 1), ("is_expert_parallel", "yes")):
        with pytest.raises(TypeError, match=rf"param_groups\[1\] sets {key}={value!r} "
                                            rf"\({type(value).__name__}\); expected True"):
            build(groups(_transformer_like(torch.float32), **{key: value}))


def _overrides(lr_mult: Any) -> dict[Any, dict[str, Any]]:
    """Overrides of every kind of group the scheduler drives: wd_mult 0, 0.5 and 1 (the
    params no key matches), a decoupled lr (the max_lr / min_lr megatron-core's standard
    overrides give the embedding and output layer), and an lr multiplier on the expert
    weights (``lr_mult(override)``)."""
    return {
        megatron.ParamKey(name="*.bias"): {"wd_mult": 0.0},
        megatron.ParamKey(name="linear_qkv.weight"): {"wd_mult": 0.5},
        megatron.ParamKey(attr="is_embedding_or_output_parameter"):
            {"max_lr": 3e-2, "min_lr": 2e-3},
        megatron.ParamKey(name="expert.weight"): lr_mult,
    }


@pytest.mark.parametrize("path", ["from_optimizer_config", "torch_optimizer"])
@pytest.mark.parametrize("wd_incr_style", ["linear", "cosine"])
def test_megatrons_scheduler_drives_the_groups_as_megatron_core(path: str,
                                                              wd_incr_style: str) -> None:
    """megatron-core 0.16.1's ``OptimizerParamScheduler`` (warmup from a nonzero
    ``init_lr``, cosine decay, a growing weight decay) over the facade and over what
    megatron-core steps, ``torch.optim.AdamW`` of its ``_get_param_groups``: every param's
    group holds the same lr and weight decay at every step, and the params agree. The
    facade's ``lr_mult=2`` group runs as megatron-core's group whose ``max_lr`` /
    ``min_lr`` are twice the config's (its scheduler never reads ``lr_mult``); a group's
    ``wd_mult`` is applied once, by the scheduler, as in megatron-core."""
    config = megatron.OptimizerConfig(lr=1e-2, min_lr=1e-4, weight_decay=0.05, clip_grad=0.0)
    ours, ref = _Attention(), _Attention()
    twice = {"max_lr": 2 * config.lr, "min_lr": 2 * config.min_lr}
    if path == "from_optimizer_config":
        opt = functopt.MixedPrecisionOptimizer.from_optimizer_config(
            config, ours, _overrides({"lr_mult": 2.0}))
    else:  # megatron-core's own groups, handed to torch.optim.AdamW and then the facade
        opt = functopt.MixedPrecisionOptimizer(torch.optim.AdamW(
            _megatron_groups(ours, config, _overrides({"lr_mult": 2.0})), lr=config.lr,
            weight_decay=config.weight_decay), loss_scale=None, return_grad_stats=True)
    theirs = torch.optim.AdamW(_megatron_groups(ref, config, _overrides(twice)),
                               lr=config.lr, weight_decay=config.weight_decay)

    def schedule(o: Any) -> OptimizerParamScheduler:
        return OptimizerParamScheduler(
            o, init_lr=1e-3, max_lr=config.lr, min_lr=config.min_lr, lr_warmup_steps=3,
            lr_decay_steps=10, lr_decay_style="cosine", start_wd=0.02, end_wd=0.1,
            wd_incr_steps=10, wd_incr_style=wd_incr_style)

    def values(o: Any, model: torch.nn.Module) -> list[tuple[float, float]]:
        by_param = {id(p): (g["lr"], g["weight_decay"]) for g in o.param_groups
                    for p in (q[1] if isinstance(q, tuple) else q for q in g["params"])}
        return [by_param[id(p)] for p in model.parameters()]

    schedules = schedule(opt), schedule(theirs)
    seen = set()
    for step in range(12):
        assert values(opt, ours) == values(theirs, ref)
        seen.update(values(theirs, ref))
        g = torch.Generator().manual_seed(step)
        for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        assert opt.step()[0]
        theirs.step()
        for sched in schedules:
            sched.step(1)
    for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
    lrs, decays = {lr for lr, _ in seen}, {wd for _, wd in seen}
    assert max(lrs) == pytest.approx(3e-2) and 2 * config.lr in lrs  # decoupled, lr_mult
    assert 0.0 in decays and any(0 < wd < 0.1 * 0.5 for wd in decays)  # wd_mult 0 and 0.5


def test_multipliers_under_a_torch_scheduler_are_torchs_groups_of_the_products() -> None:
    """``lr_mult`` / ``wd_mult`` under ``torch.optim.lr_scheduler``: the facade runs as
    torch.optim.AdamW whose groups hold ``lr * lr_mult`` and ``weight_decay * wd_mult``
    (the scheduler anneals each group from its own lr to the common ``eta_min``)."""
    ours, ref = _transformer_like(torch.float32), _transformer_like(torch.float32)
    opt = functopt.MixedPrecisionOptimizer(torch.optim.AdamW(
        [{"params": ours[0].parameters(), "lr_mult": 2.0, "wd_mult": 0.5},
         {"params": ours[1].parameters(), "wd_mult": 0.0},
         {"params": ours[2].parameters()}], lr=1e-2, weight_decay=0.2), loss_scale=None)
    theirs = torch.optim.AdamW(
        [{"params": ref[0].parameters(), "lr": 2e-2, "weight_decay": 0.1},
         {"params": ref[1].parameters(), "weight_decay": 0.0},
         {"params": ref[2].parameters()}], lr=1e-2, weight_decay=0.2)
    schedules = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=6, eta_min=1e-3)
                 for o in (opt, theirs)]
    for step in range(6):
        assert [(g["lr"], g["weight_decay"]) for g in opt.param_groups] == [
            (g["lr"], g["weight_decay"]) for g in theirs.param_groups]
        for model in (ours, ref):
            _loss(model, step).backward()
        assert opt.step()
        theirs.step()
        opt.zero_grad()
        theirs.zero_grad()
        for sched in schedules:
            sched.step()
    for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert [g.get("lr_mult", 1.0) for g in opt.param_groups] == [2.0, 1.0, 1.0]


@pytest.mark.parametrize("key", ["lr_mult", "wd_mult"])
def test_a_multiplier_changed_after_construction_is_refused(key: str) -> None:
    model = _transformer_like(torch.float32)
    opt = functopt.MixedPrecisionOptimizer(torch.optim.AdamW(
        [{"params": model.parameters(), "lr_mult": 2.0, "wd_mult": 0.5}], lr=1e-2),
        loss_scale=None)
    opt.param_groups[0][key] = 4.0
    _loss(model, 0).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"param_groups\[0\] changed lr_mult / wd_mult .*"
                                         r"act once, when the group is added.*write the group's lr"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def _megatron_public_names() -> set[str]:
    """What megatron-core's ``megatron.core.optimizer`` defines and exports (classes and
    functions of its own modules), and the public methods of its optimizers."""
    import inspect

    from megatron.core.optimizer import clip_grads, grad_scaler
    from megatron.core.optimizer import optimizer as classes
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    names = set()
    for module_name, value in [*vars(megatron).items(), *vars(clip_grads).items(),
                               *vars(grad_scaler).items()]:
        defined = getattr(value, "__module__", "") or ""
        if not module_name.startswith("_") and (inspect.isclass(value) or inspect.isfunction(
                value)) and defined.startswith("megatron.core.optimizer"):
            names.add(module_name)
    for cls in (classes.MegatronOptimizer, classes.MixedPrecisionOptimizer,
                classes.Float16OptimizerWithFloat16Params, classes.FP32Optimizer,
                classes.ChainedOptimizer, DistributedOptimizer):
        names.update(n for n in vars(cls) if not n.startswith("_"))
    return names


def test_coming_from_megatron_names_every_public_name_of_megatron_core() -> None:
    page = (Path(__file__).resolve().parents[1] / "docs" / "coming-from-megatron.md"
            ).read_text()
    names = _megatron_public_names()
    assert {"get_megatron_optimizer", "ParamKey", "save_parameter_state",
            "step_with_ready_grads"} <= names  # (the enumeration finds them)
    missing = sorted(n for n in names if not re.search(rf"`[^`]*\b{re.escape(n)}\b", page))
    assert not missing, f"docs/coming-from-megatron.md does not name {missing}"


def _trained(model: torch.nn.Module, opt: functopt.MixedPrecisionOptimizer,
             steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        opt.backward(_loss(model, step))
        opt.step()


def test_parameter_state_saved_to_one_file_resumes_the_run_bitwise(tmp_path: Path) -> None:
    # DistributedOptimizer.save_parameter_state / load_parameter_state (megatron-core
    # 0.16.1, megatron/core/optimizer/distrib_optimizer.py: its CUDA-only code gathers the
    # state to data-parallel rank 0 into one file, which load_parameter_state reads there
    # and scatters); the two-rank run is in tests/distributed/checkpoint_checks.py
    model, reference = _model(), _model()
    opt, ref_opt = _facade(model), _facade(reference)
    _trained(model, opt, range(3))
    _trained(reference, ref_opt, range(6))
    path = tmp_path / "parameter_state.pt"
    opt.save_parameter_state(path)
    saved = torch.load(path, weights_only=True)
    assert set(saved["state"]) == {name for name, _ in model.named_parameters()}
    resumed = _model(seed=1)  # other values: the masters in the file set the params
    new_opt = _facade(resumed)
    new_opt.load_parameter_state(path)
    assert [p.tolist() for p in resumed.parameters()] == [p.tolist() for p in model.parameters()]
    _trained(resumed, new_opt, range(3, 6))
    for p, q in zip(resumed.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)
    assert new_opt.loss_scale == ref_opt.loss_scale
    # the file is named_state_dict()'s layout: it loads that way on one process too
    other = _facade(_model(seed=2))
    other.load_named_state_dict(saved)
    assert torch.equal(other.named_state_dict()["state"]["0.weight"]["master"],
                       opt.named_state_dict()["state"]["0.weight"]["master"])
    with pytest.raises(ValueError, match="update_legacy_format=True"):
        new_opt.load_parameter_state(path, update_legacy_format=True)
