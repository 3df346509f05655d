"""``compile=True`` on functopt.Optimizer and the functopt.optim classes: the combination
rules, the compiled tier taken, equal to the eager class, and the flag kept by a pickle."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch

import functopt
from functopt import fast

pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def _params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(8, 8), (16,), (3,)]]


def test_compile_with_fused_false_raises() -> None:
    with pytest.raises(ValueError, match="compile=True with fused=False"):
        functopt.Optimizer(_params(), functopt.adamw(1e-3), fused=False, compile=True)
    with pytest.raises(ValueError, match="compile=True with fused=False"):
        functopt.optim.Adam(_params(), fused=False, compile=True)


def test_compile_with_differentiable_raises() -> None:
    with pytest.raises(ValueError, match="compile=True with differentiable=True"):
        functopt.optim.AdamW(_params(), differentiable=True, compile=True)
    opt = functopt.optim.AdamW(_params(), compile=True)
    with pytest.raises(ValueError, match="compile=True with differentiable=True"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))],
                             "differentiable": True})


def test_adafactor_refuses_compile() -> None:
    # its rule steps run by run, outside the compiled tier: no step would be compiled
    with pytest.raises(ValueError, match="Adafactor: compile=True"):
        functopt.optim.Adafactor(_params(), compile=True)
    assert not functopt.optim.Adafactor(_params())._compile


def _step_both(a: Any, eager: list[Any], b: Any, compiled: list[Any]) -> None:
    """Three steps of two optimizers on the same gradients."""
    for _ in range(3):
        for p, q in zip(eager, compiled, strict=True):
            grad = torch.randn(p.shape)
            p.grad, q.grad = grad.clone(), grad.clone()
        a.step()
        b.step()


# neither has a torch kernel: the compiled tier takes them
@pytest.mark.parametrize("name", ["RAdam", "NAdam"])
def test_compiled_class_equals_eager_and_pickles_with_the_flag(name: str) -> None:
    from torch._dynamo.utils import counters

    cls = getattr(functopt.optim, name)
    eager, compiled = _params(), _params()
    a = cls(eager, lr=1e-2)
    b = cls(compiled, lr=1e-2, compile=True)
    assert {g.kernel for g in fast.explain(b.transform, compiled, compile=True).groups} == {
        "compiled"}
    before = counters["stats"]["unique_graphs"]
    _step_both(a, eager, b, compiled)
    assert counters["stats"]["unique_graphs"] > before  # the step ran compiled
    for p, q in zip(eager, compiled, strict=True):
        torch.testing.assert_close(q, p, rtol=3 * torch.finfo(torch.float32).eps, atol=1e-7)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(b.state[q][key], a.state[p][key],
                                       rtol=3 * torch.finfo(torch.float32).eps, atol=1e-7)
    assert pickle.loads(pickle.dumps(b))._compile is True
    assert set(b.state_dict()["param_groups"][0]) == set(a.state_dict()["param_groups"][0])


def test_a_class_with_a_torch_kernel_keeps_it_when_compiling() -> None:
    """AdamW(compile=True) steps on torch's fused kernel (as fast as the compiled call over
    laid-out tensors, faster than one gathering separate ones), compiling nothing: bitwise
    the eager class, which takes the same kernel."""
    from torch._dynamo.utils import counters

    eager, compiled = _params(), _params()
    a = functopt.optim.AdamW(eager, lr=1e-2)
    b = functopt.optim.AdamW(compiled, lr=1e-2, compile=True)
    assert {g.kernel for g in fast.explain(b.transform, compiled, compile=True).groups} == {
        "torch._fused_adamw_"}
    before = counters["stats"]["unique_graphs"]
    _step_both(a, eager, b, compiled)
    assert counters["stats"]["unique_graphs"] == before
    for p, q in zip(eager, compiled, strict=True):
        assert torch.equal(q, p)
        assert torch.equal(b.state[q]["exp_avg_sq"], a.state[p]["exp_avg_sq"])
