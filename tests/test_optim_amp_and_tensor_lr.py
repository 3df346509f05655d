"""Two torch.optim protocols the ``functopt.optim`` classes follow as torch's do.

- A learning rate given as a one-element tensor of any shape (``torch.tensor(1e-3)``
  reshaped to ``(1,)`` or ``(1, 1)``) trains as the same float, and the groups keep the
  caller's tensor (a scheduler may fill it in place).
- ``optimizer.grad_scale`` / ``optimizer.found_inf``, which ``GradScaler`` sets on a fused
  optimizer: a nonzero ``found_inf`` skips the step, ``grad_scale`` divides the gradients
  in place first; a class whose torch twin has no fused implementation, or a group that is
  not fused, behaves as torch's (the latter raises its ``AssertionError``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from functopt import optim

NAMES = ["Adam", "AdamW", "SGD", "RMSprop", "Adagrad", "NAdam", "RAdam", "Adamax",
         "Adadelta", "Rprop", "Adafactor", "Muon"]
FUSED = ["Adam", "AdamW", "SGD", "Adagrad"]
# (Adagrad's fused=True has no functopt kernel: it warns that the step takes the pure path)
_NO_KERNEL = pytest.mark.filterwarnings("ignore::functopt.fast.FastPathWarning")


def _train(opt: Any, ps: list[torch.nn.Parameter], steps: int = 3) -> None:
    for t in range(steps):
        for p in ps:
            p.grad = torch.sin(p.detach() * (t + 1))
        opt.step()


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)], ids=["0d", "1d", "2d"])
@pytest.mark.parametrize("name", NAMES)
def test_a_one_element_tensor_lr_trains_as_the_float(name: str, shape: tuple[int, ...]) -> None:
    lr = 1.0 if name == "Adadelta" else 1e-2
    g = torch.Generator().manual_seed(0)
    start = torch.randn(6, 5, generator=g, dtype=torch.float64)
    w, v = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    tensor_lr = torch.tensor(lr, dtype=torch.float64).reshape(shape)
    by_float = getattr(optim, name)([w], lr=lr)
    by_tensor = getattr(optim, name)([v], lr=tensor_lr)
    assert by_tensor.param_groups[0]["lr"] is tensor_lr
    _train(by_float, [w])
    _train(by_tensor, [v])
    torch.testing.assert_close(v, w, rtol=1e-14, atol=1e-14)


def _fused(module: Any, name: str, ps: list[torch.nn.Parameter]) -> Any:
    options = {"momentum": 0.9} if name == "SGD" else {}
    return getattr(module, name)(ps, lr=0.1, fused=True, **options)


def _scaled_run(module: Any, name: str, found: list[bool]) -> tuple[list[Any], list[Any]]:
    g = torch.Generator().manual_seed(1)
    ps = [torch.nn.Parameter(torch.randn(3, 2, generator=g)) for _ in range(2)]
    opt = _fused(module, name, ps)
    for t, skipped in enumerate(found):
        for p in ps:
            p.grad = torch.sin(p.detach() * (t + 1)) * 4.0
        opt.grad_scale = torch.full((1,), 4.0)
        opt.found_inf = torch.full((), float(skipped))
        opt.step()
        del opt.grad_scale, opt.found_inf
    return [p.detach().clone() for p in ps], [p.grad.clone() for p in ps]


@_NO_KERNEL
@pytest.mark.parametrize("name", FUSED)
def test_fused_steps_follow_grad_scale_and_found_inf_as_torch(name: str) -> None:
    found = [False, True, False, False]
    ours, theirs = _scaled_run(optim, name, found), _scaled_run(torch.optim, name, found)
    # params, and the gradients unscaled in place as torch's kernels leave them: bitwise
    # where functopt runs torch's kernel, else to rounding (Adagrad; its gradients are of
    # the params)
    for a, b in zip([*ours[0], *ours[1]], [*theirs[0], *theirs[1]], strict=True):
        if name == "Adagrad":
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(a, b)


@_NO_KERNEL
@pytest.mark.parametrize("name", FUSED)
def test_found_inf_skips_the_step_and_its_counts(name: str) -> None:
    ps = [torch.nn.Parameter(torch.ones(2)) for _ in range(2)]
    for p in ps:
        p.grad = torch.ones(2)
    opt = _fused(optim, name, ps)
    opt.grad_scale, opt.found_inf = torch.ones(1), torch.ones(())
    opt.step()
    assert all(torch.equal(p, torch.ones(2)) for p in ps)
    saved = opt.state_dict()["state"]
    assert all(float(entry.get("step", 0)) == 0 for entry in saved.values())
    del opt.grad_scale, opt.found_inf
    opt.step()  # the next step is the first
    assert all(float(entry["step"]) == 1 for entry in opt.state_dict()["state"].values()
               if "step" in entry)


@pytest.mark.parametrize("name", FUSED)
def test_a_group_that_is_not_fused_refuses_the_attributes_as_torch(name: str) -> None:
    for module in (torch.optim, optim):
        p = torch.nn.Parameter(torch.ones(2))
        p.grad = torch.ones(2)
        opt = getattr(module, name)([p], lr=0.1)
        opt.found_inf = torch.zeros(())
        with pytest.raises(AssertionError, match="Expected grad_scale and found_inf to be None"):
            opt.step()
