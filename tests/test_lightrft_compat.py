"""``functopt.lightrft``: LightRFT's optimizer names, signatures and behaviour over the facade.

The reference is LightRFT's source, read at zunian-wan/LightRFT commit
8c876fd212985c553a86d75a80d16947b98cb3da: ``lightrft/strategy/fsdp/fsdp_optimizer.py``
(``FSDPadaptOptimizer``, ``offload_fsdp_optimizer``, ``load_fsdp_optimizer``,
``DTENSOR_SUPPORTED``) and ``lightrft/strategy/fsdp/fsdp_utils.py`` (``BaseOptimizer``, whose
public methods ``FSDPadaptOptimizer`` inherits, and ``DynamicGradScaler``). LightRFT does
not run here (it needs CUDA); its signatures are data below and its clipping rule is
transcribed in float64 (``lightrft_step64``).
"""

from __future__ import annotations

import importlib.util
import inspect
import math
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import functopt
from functopt.lightrft import (
    DTENSOR_SUPPORTED,
    LIGHTRFT_CLIP_EPS,
    FSDPadaptOptimizer,
    load_fsdp_optimizer,
    offload_fsdp_optimizer,
)
from functopt.precision import NormClip, mixed_precision, static_loss_scale
from functopt.testing import assert_bitwise_equal

P = inspect.Parameter
POS = P.POSITIONAL_OR_KEYWORD
NONE = P.empty
CUDA_CURRENT = "torch.cuda.current_device() at import"  # a default that needs CUDA

# LightRFT's public methods of FSDPadaptOptimizer (its own and BaseOptimizer's), each as
# its parameters after self: (name, kind, default). add_param_group takes *args, **kwargs
# and forwards them to torch's add_param_group(param_group), which is what it accepts.
LIGHTRFT_METHODS: dict[str, list[tuple[str, Any, Any]]] = {
    "__init__": [("optimizer", POS, NONE)],
    "backward": [("loss", POS, NONE), ("retain_graph", POS, False)],
    "zero_grad": [],
    "step": [],
    "clip_grad_norm": [("model", POS, NONE), ("max_norm", POS, NONE)],
    "state_dict": [],
    "load_state_dict": [("states", POS, NONE)],
    "add_param_group": [("param_group", POS, NONE)],
    "backward_by_grad": [("tensor", POS, NONE), ("grad", POS, NONE)],
}
# Positional names kept as torch.optim spells them (DCP and the frameworks pass
# state_dict= by keyword): LightRFT's name -> functopt's.
RENAMED = {("load_state_dict", "states"): "state_dict"}
LIGHTRFT_PROPERTIES = ["loss_scale", "param_groups", "defaults"]  # (torch's: attributes)
# Public attributes of LightRFT's object that functopt does not keep: reading one raises.
LIGHTRFT_NOT_KEPT = {"optim": r"does not keep it\. Fix: use the optimizer itself",
                     "grad_scaler": r"the loss scale is part of functopt's state"}
LIGHTRFT_FUNCTIONS: dict[str, list[tuple[str, Any, Any]]] = {
    "offload_fsdp_optimizer": [("optimizer", POS, NONE)],
    "load_fsdp_optimizer": [("optimizer", POS, NONE), ("device_id", POS, CUDA_CURRENT)],
}


def _check_compatible(where: str, ours: inspect.Signature,
                      theirs: list[tuple[str, Any, Any]], renamed: dict[str, str]) -> None:
    """Every call LightRFT's signature accepts, ours accepts: its parameters in its order,
    with its kinds and defaults (a default that needs CUDA: any default), then only
    parameters with defaults (or ``**options``)."""
    params = [p for p in ours.parameters.values() if p.name != "self"]
    assert len(params) >= len(theirs), f"{where}: {ours} lacks parameters of {theirs}"
    for p, (name, kind, default) in zip(params, theirs, strict=False):
        assert p.name == renamed.get(name, name), f"{where}: {p.name} for {name}"
        assert p.kind == kind, f"{where}.{name}: {p.kind} for {kind}"
        if default is CUDA_CURRENT:
            assert p.default is not NONE, f"{where}.{name} needs a default"
        else:
            assert p.default == default, f"{where}.{name}: default {p.default!r}"
    for p in params[len(theirs):]:
        assert p.default is not NONE or p.kind is P.VAR_KEYWORD, (
            f"{where}: the extra parameter {p.name} has no default")


@pytest.mark.parametrize("name", list(LIGHTRFT_METHODS))
def test_every_method_takes_lightrfts_arguments(name: str) -> None:
    renamed = {theirs: ours for (method, theirs), ours in RENAMED.items() if method == name}
    _check_compatible(name, inspect.signature(getattr(FSDPadaptOptimizer, name)),
                      LIGHTRFT_METHODS[name], renamed)


@pytest.mark.parametrize("name", list(LIGHTRFT_FUNCTIONS))
def test_every_function_takes_lightrfts_arguments(name: str) -> None:
    _check_compatible(name, inspect.signature(getattr(functopt.lightrft, name)),
                      LIGHTRFT_FUNCTIONS[name], {})


def test_the_module_has_every_public_name_of_lightrfts() -> None:
    names = {"FSDPadaptOptimizer", "DTENSOR_SUPPORTED", *LIGHTRFT_FUNCTIONS}
    assert names <= set(functopt.lightrft.__all__)
    assert DTENSOR_SUPPORTED is (importlib.util.find_spec("torch.distributed.tensor") is not None)
    opt = _compat(_model())[1]
    assert isinstance(FSDPadaptOptimizer.loss_scale, property)
    for name in LIGHTRFT_PROPERTIES:
        getattr(opt, name)
    assert opt.defaults["lr"] == 1e-2 and opt.param_groups[0]["weight_decay"] == 0.01
    assert isinstance(opt, functopt.MixedPrecisionOptimizer)
    assert isinstance(opt, torch.optim.Optimizer)


@pytest.mark.parametrize("name", list(LIGHTRFT_NOT_KEPT))
def test_lightrft_attributes_not_kept_raise_saying_what_to_use(name: str) -> None:
    opt = _compat(_model())[1]
    with pytest.raises(AttributeError, match=LIGHTRFT_NOT_KEPT[name]):
        getattr(opt, name)


# -- the clipping rule ----------------------------------------------------------------------


def lightrft_step64(param: torch.Tensor, grad: torch.Tensor, max_norm: float,
                    lr: float) -> torch.Tensor:
    """One SGD step after LightRFT's clip, in float64: the factor is
    1 / max(1, (||g|| + 1e-6) / max_norm), the norm over the whole gradient."""
    g = grad.double()
    norm = math.sqrt(float((g * g).sum()))
    factor = 1.0 / max(1.0, (norm + 1e-6) / max_norm)
    return param.double() - lr * (g * factor)


@given(seed=st.integers(0, 2**16),
       # the norm relative to the bound: below, inside LightRFT's 1e-6 band (only its rule
       # clips there), at it, and above
       norm=st.sampled_from([0.25, 1.0 - 5e-7, 1.0 - 1e-7, 1.0, 1.0 + 1e-9, 3.0, 1e3]),
       max_norm=st.sampled_from([1.0, 0.5, 2.0]))
def test_the_clip_is_lightrfts_rule_in_float64(seed: int, norm: float, max_norm: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    grad = torch.randn(7, generator=gen, dtype=torch.float64)
    grad = grad * (norm * max_norm / grad.norm())
    w = torch.nn.Parameter(torch.randn(7, generator=gen, dtype=torch.float64))
    expected = lightrft_step64(w.detach(), grad, max_norm, lr=0.5)
    opt = FSDPadaptOptimizer(torch.optim.SGD([w], lr=0.5), max_norm=max_norm)
    w.grad = grad.clone()
    assert opt.step()
    torch.testing.assert_close(w.detach(), expected, rtol=1e-15, atol=1e-15)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "pure"])
def test_global_norm_clip_without_eps_is_the_plain_number_bitwise(fused: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    params = {"a": torch.randn(33, generator=gen).to(torch.bfloat16), "b": torch.randn(5)}
    grads = {k: (torch.randn(v.shape, generator=gen) * 4).to(v.dtype) for k, v in params.items()}
    out = [mixed_precision(functopt.adamw(1e-2), max_grad_norm=clip, fused=fused).step(
        grads, mixed_precision(functopt.adamw(1e-2)).init(params), params)
        for clip in (1.0, NormClip(1.0))]
    assert float(out[0][1].metrics.grad_norm) > 1.0  # it clips
    assert_bitwise_equal(out[0], out[1])


@pytest.mark.parametrize(("args", "error", "match"), [
    ((0.0,), ValueError, r"NormClip: max_norm must be a finite number > 0, got 0\.0"),
    ((math.inf,), ValueError, r"max_norm must be a finite number > 0, got inf"),
    ((1.0, -1e-6), ValueError, r"eps must be a finite number >= 0, got -1e-06"),
    ((1.0, math.nan), ValueError, r"eps must be a finite number >= 0, got nan"),
    (("1.0",), TypeError, r"max_norm must be a Python number, got str"),
    ((True,), TypeError, r"max_norm must be a Python number, got bool"),
    ((1.0, torch.tensor(1e-6)), TypeError, r"eps must be a Python number, got Tensor"),
])
def test_global_norm_clip_refuses_bad_fields(args: tuple[Any, ...], error: type,
                                             match: str) -> None:
    with pytest.raises(error, match=match):
        NormClip(*args)


def _one_step(**kwargs: Any) -> torch.Tensor:
    """The bfloat16 param after one SGD step (lr 1) from 0 with the gradient [3, 4]."""
    w = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    opt = FSDPadaptOptimizer(torch.optim.SGD([w], lr=1.0), **kwargs)
    w.grad = torch.tensor([3.0, 4.0], dtype=torch.bfloat16)  # norm 5
    assert opt.step()
    assert w.grad is None  # step() clears the gradients, as LightRFT's
    return w.detach().float()


@pytest.mark.parametrize(("kwargs", "expected"), [
    ({}, [-3.0 / (5 + 1e-6), -4.0 / (5 + 1e-6)]),  # on by default, at 1.0, LightRFT's rule
    ({"max_norm": 2.0}, [-6.0 / (5 + 1e-6), -8.0 / (5 + 1e-6)]),
    ({"max_norm": None}, [-3.0, -4.0]),  # off
    ({"max_norm": 0.0}, [-3.0, -4.0]),  # off, as LightRFT's "> 0" test
])
def test_clipping_is_on_by_default_and_off_when_asked(kwargs: dict[str, Any],
                                                      expected: list[float]) -> None:
    assert torch.equal(_one_step(**kwargs), torch.tensor(expected).to(torch.bfloat16).float())


def test_clip_grad_norm_sets_the_clip_of_the_following_steps() -> None:
    w = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    opt = FSDPadaptOptimizer(torch.optim.SGD([w], lr=1.0), max_norm=None)
    opt.clip_grad_norm(None, 0.5)
    assert opt._max_grad_norm == NormClip(0.5, eps=LIGHTRFT_CLIP_EPS)
    w.grad = torch.tensor([3.0, 4.0], dtype=torch.bfloat16)
    opt.step()
    assert torch.equal(w.detach(), torch.tensor([-0.3, -0.4], dtype=torch.bfloat16))
    opt.clip_grad_norm(None, 0)
    assert opt._max_grad_norm is None


@pytest.mark.parametrize(("value", "error", "match"), [
    (-1.0, ValueError, r"max_norm must be a finite number >= 0 \(0 or None switch clipping "
                       r"off\), got -1\.0"),
    (math.nan, ValueError, r"max_norm must be a finite number >= 0"),
    (True, TypeError, r"max_norm must be a Python number or None, got bool"),
    ("1.0", TypeError, r"max_norm must be a Python number or None, got str"),
])
def test_bad_max_norm_raises(value: Any, error: type, match: str) -> None:
    w = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    with pytest.raises(error, match=f"FSDPadaptOptimizer: {match}"):
        FSDPadaptOptimizer(torch.optim.SGD([w], lr=1.0), max_norm=value)
    opt = FSDPadaptOptimizer(torch.optim.SGD([w], lr=1.0))
    with pytest.raises(error, match=f"FSDPadaptOptimizer.clip_grad_norm: {match}"):
        opt.clip_grad_norm(None, value)


# -- training -------------------------------------------------------------------------------


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 1)).to(torch.bfloat16)


def _compat(model: torch.nn.Module, **kwargs: Any) -> tuple[torch.nn.Module, FSDPadaptOptimizer]:
    return model, FSDPadaptOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), **kwargs)


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(32, 4, generator=gen)
    return ((model(x.to(torch.bfloat16)).float() - 8 * x.sum(1, keepdim=True)) ** 2).mean()


def test_a_bf16_loop_equals_the_facade_with_lightrfts_clip_and_scale() -> None:
    """The compat class is the facade with LightRFT's settings: a constant loss scale of
    1.0, the clip at 1.0 by LightRFT's rule, the gradients cleared after each step. An inf
    at step 3 skips the step on both (and the scale stays 1.0)."""
    model, opt = _compat(_model())
    ref_model = _model()
    ref = functopt.MixedPrecisionOptimizer(torch.optim.AdamW(ref_model.parameters(), lr=1e-2),
                                           loss_scale=static_loss_scale(1.0))
    ref.clip_grad_norm(ref_model, NormClip(1.0, eps=1e-6))
    norms = []
    for step in range(8):
        opt.backward(_loss(model, step))
        ref.backward(_loss(ref_model, step))
        if step == 3:
            for m in (model, ref_model):
                m[0].bias.grad[0] = math.inf
        took = opt.step()
        assert took == ref.step() == (step != 3)
        norms.append(float(ref.get_grad_norm()))
        ref.zero_grad()
        assert all(p.grad is None for p in model.parameters())
        assert_bitwise_equal(dict(model.named_parameters()), dict(ref_model.named_parameters()))
        assert_bitwise_equal(opt.state_dict(), ref.state_dict())
    assert sum(n > 1.0 for n in norms if math.isfinite(n)) >= 3  # the clip acted
    assert torch.equal(opt.loss_scale, torch.ones(1))


def test_loss_scale_is_a_tensor_as_lightrfts() -> None:
    model, opt = _compat(_model())
    scale = opt.loss_scale
    assert isinstance(scale, torch.Tensor)
    assert scale.shape == (1,) and scale.dtype == torch.float32 and scale.item() == 1.0
    assert isinstance(functopt.MixedPrecisionOptimizer(
        torch.optim.AdamW(_model().parameters())).loss_scale, float)  # the facade's: a float
    # backward scales by it (1.0: the gradients of loss.backward(), bitwise)
    twin = _model()
    _loss(twin, 0).backward()
    opt.backward(_loss(model, 0))
    assert_bitwise_equal([p.grad for p in model.parameters()],
                         [p.grad for p in twin.parameters()])
    out = model(torch.ones(2, 4, dtype=torch.bfloat16))
    opt.zero_grad()
    opt.backward_by_grad(out, torch.ones_like(out))
    out2 = twin(torch.ones(2, 4, dtype=torch.bfloat16))
    twin.zero_grad()
    torch.autograd.backward(out2, torch.ones_like(out2))
    assert_bitwise_equal([p.grad for p in model.parameters()],
                         [p.grad for p in twin.parameters()])


def test_offload_and_load_round_trip_bitwise() -> None:
    model, opt = _compat(_model())
    twin, ref = _compat(_model())
    for step in range(6):
        for m, o in ((model, opt), (twin, ref)):
            o.backward(_loss(m, step))
            assert o.step()
        before = opt.state_dict()
        offload_fsdp_optimizer(opt)
        with pytest.raises(RuntimeError, match=r"the optimizer state is offloaded"):
            opt.step()
        load_fsdp_optimizer(opt, "cpu" if step % 2 else None)
        assert_bitwise_equal(opt.state_dict(), before)
    assert_bitwise_equal(dict(model.named_parameters()), dict(twin.named_parameters()))
    assert_bitwise_equal(opt.state_dict(), ref.state_dict())


@pytest.mark.parametrize(("device_id", "match"), [
    ("meta", r"device_id='meta', but the state came from cpu"),
    (0, r"device_id=0"),  # an accelerator index: none here, or not the params' device
])
def test_load_honours_device_id(device_id: Any, match: str) -> None:
    _, opt = _compat(_model())
    offload_fsdp_optimizer(opt)
    with pytest.raises(ValueError, match=match):
        load_fsdp_optimizer(opt, device_id)
    load_fsdp_optimizer(opt, torch.device("cpu"))
    with pytest.raises(RuntimeError, match=r"restore_from_cpu: the state is not offloaded"):
        load_fsdp_optimizer(opt, "cpu")  # a second load without an offload between


@pytest.mark.parametrize("function", [offload_fsdp_optimizer, load_fsdp_optimizer])
def test_the_functions_refuse_a_plain_torch_optimizer(function: Any) -> None:
    with pytest.raises(TypeError, match=r"optimizer must be a functopt FSDPadaptOptimizer or "
                                        r"MixedPrecisionOptimizer, got AdamW"):
        function(torch.optim.AdamW(_model().parameters()))


def test_what_cannot_be_honoured_raises() -> None:
    model, opt = _compat(_model())
    lightrft_checkpoint = {"grad_scaler": {"_scale": 1.0}, "base_optim_states": {},
                           "flat_fp32_weights": {0: []}}
    with pytest.raises(ValueError, match=r"this is a LightRFT FSDPadaptOptimizer checkpoint"):
        opt.load_state_dict(lightrft_checkpoint)
    with pytest.raises(TypeError, match=r"return_grad_stats is not an option here"):
        FSDPadaptOptimizer(torch.optim.AdamW(model.parameters()), return_grad_stats=True)
    with pytest.raises(TypeError, match=r"optimizer must be a torch.optim optimizer .*got list"):
        FSDPadaptOptimizer(list(model.parameters()))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"got FSDPadaptOptimizer"):
        FSDPadaptOptimizer(opt)


def test_a_checkpoint_resumes_bitwise() -> None:
    model, opt = _compat(_model())
    for step in range(3):
        opt.backward(_loss(model, step))
        opt.step()
    resumed_model = _model(1)
    resumed_model.load_state_dict(model.state_dict())
    _, resumed = _compat(resumed_model)
    resumed.load_state_dict(opt.state_dict())
    for step in range(3, 6):
        for m, o in ((model, opt), (resumed_model, resumed)):
            o.backward(_loss(m, step))
            o.step()
    assert_bitwise_equal(dict(model.named_parameters()), dict(resumed_model.named_parameters()))
