"""The program engine on the adapters' flat entry: ``functopt.optim`` equals its pure path.

``functopt.Optimizer`` and the ``functopt.optim`` classes step through ``Step._step_flat``
(``functopt/fast/_step.py``), which takes the program engine while its switch is on
(``functopt/fast/_engine.py``). With the eager backend alone (the rules' own updates) a
class's params and ``optimizer.state`` after several steps are bitwise those of the same
class on its pure path (the switch off, ``fused=False``); with the default backends
(the kernels first) Adam, AdamW, SGD and RMSprop equal ``torch.optim``'s classes within
the fast-path tolerance (``functopt/testing/_fast.py``). The classes whose steps do not
reach the engine are a table here, with the reason.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import functopt.optim as O
from functopt.fast import FastPathWarning, _backends
from functopt.testing import _fast, assert_bitwise_equal

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_program import engine

STEPS = 3

# (class, options): ``fused=True`` where the class takes it, so that an option set the
# kernels do not lower (maximize, dampening) still runs the fused step function the engine
# takes, as ``fused=None`` does for the options they lower.
CASES: list[tuple[str, dict[str, Any]]] = [
    ("Adam", {}),
    ("Adam", {"fused": True, "amsgrad": True, "maximize": True, "weight_decay": 0.1}),
    ("Adam", {"fused": True, "decoupled_weight_decay": True, "weight_decay": 0.1}),
    ("AdamW", {}),
    ("AdamW", {"fused": True, "amsgrad": True, "weight_decay": 0.05}),
    ("AdamW", {"fused": True, "maximize": True}),
    ("SGD", {"lr": 0.1}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "fused": True, "dampening": 0.5,
             "maximize": True}),
    ("Adagrad", {"fused": True}),
    ("Adagrad", {"fused": True, "weight_decay": 0.1, "lr_decay": 0.01, "maximize": True}),
    ("Muon", {"lr": 0.02}),
    ("Muon", {"lr": 0.02, "nesterov": False, "weight_decay": 0.1}),
]

# The classes whose steps never reach the engine, and why: they take no ``fused`` argument
# and step with ``make_step(fused=False)`` (the pure chain, as torch picks foreach), which
# the engine, as the planner, leaves alone.
REFUSED: dict[str, str] = {
    name: "no fused kernel: the class steps its pure chain (make_step(fused=False))"
    for name in ("NAdam", "RAdam", "Adamax", "Adadelta", "RMSprop", "Rprop", "Adafactor")}


def _params(two_d: bool) -> list[torch.Tensor]:
    """float64 and float32 params: contiguous, transposed, channels_last (2-D only, for
    Muon: contiguous and transposed)."""
    gen = torch.Generator().manual_seed(0)

    def leaf(x: torch.Tensor) -> torch.Tensor:
        return x.detach().requires_grad_()

    made = [leaf(torch.randn(4, 3, generator=gen, dtype=torch.float64)),
            leaf(torch.randn(5, 3, generator=gen, dtype=torch.float64).t()),
            leaf(torch.randn(3, 6, generator=gen))]
    if not two_d:
        made += [leaf(torch.randn(7, generator=gen)),
                 leaf(torch.randn(2, 3, 2, 2, generator=gen, dtype=torch.float64)
                      .to(memory_format=torch.channels_last))]
    return made


def _grads(params: list[torch.Tensor], k: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + k)
    return [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]


def _run(make: Callable[[list[torch.Tensor]], Any], two_d: bool,
         before: Callable[[Any, int], None] | None = None,
         ) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    params = _params(two_d)
    opt = make(params)
    for k in range(STEPS):
        if before is not None:
            before(opt, k)
        for p, g in zip(params, _grads(params, k), strict=True):
            p.grad = g
        opt.step()
    return [p.detach() for p in params], [dict(opt.state[p]) for p in params]


@pytest.mark.parametrize("case", CASES, ids=[f"{c}-{'-'.join(o) or 'defaults'}"
                                             for c, o in CASES])
def test_class_on_the_engine_equals_its_pure_path(case: tuple[str, dict[str, Any]]) -> None:
    name, options = case
    cls, two_d = getattr(O, name), name == "Muon"
    expected = _run(lambda ps: _pure(cls(ps, **options)), two_d)
    with engine() as calls, warnings.catch_warnings():
        warnings.simplefilter("error", FastPathWarning)
        found = _run(lambda ps: cls(ps, **options), two_d)
    assert len(calls) == STEPS, f"{name}: the engine ran {len(calls)} of {STEPS} steps"
    assert_bitwise_equal(found[0], expected[0], what=f"{name} {options}: params")
    assert_bitwise_equal(found[1], expected[1], what=f"{name} {options}: optimizer.state")


def _pure(opt: Any) -> Any:
    """``opt`` on its pure path, as ``fused=False`` sets it (Muon takes no ``fused``)."""
    opt._fused = False
    return opt


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_class_does_not_reach_the_engine(name: str) -> None:
    params = _params(False)
    with engine() as calls:
        opt = getattr(O, name)(params)
        for p, g in zip(params, _grads(params, 0), strict=True):
            p.grad = g
        opt.step()
    assert not calls, f"{name}: the engine ran, so it belongs in CASES: {REFUSED[name]}"


TORCH_CASES: list[tuple[str, dict[str, Any]]] = [
    ("Adam", {"weight_decay": 0.1}),
    ("AdamW", {"amsgrad": True}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    ("RMSprop", {"momentum": 0.5, "weight_decay": 0.01}),
]


@pytest.mark.parametrize("case", TORCH_CASES, ids=[c for c, _ in TORCH_CASES])
def test_class_on_the_default_backends_equals_torch(case: tuple[str, dict[str, Any]]) -> None:
    name, options = case
    expected = _run(lambda ps: getattr(torch.optim, name)(ps, **options), False)
    with engine(("kernel", "eager")) as calls, warnings.catch_warnings():
        warnings.simplefilter("ignore", FastPathWarning)  # (a refused segment runs eager)
        found = _run(lambda ps: getattr(O, name)(ps, **options, **(
            {} if name in REFUSED else {"fused": True})), False)
    assert len(calls) == (0 if name in REFUSED else STEPS)
    for k, (p, e) in enumerate(zip(found[0], expected[0], strict=True)):
        _fast._assert_fast_close(p, e, e, check="engine vs torch.optim", what=f"{name} {k}",
                                 exact=False)


# The drop-ins' options the kernels lower: their injected hyperparameters (the state's
# tensors, which a user's ``param_groups`` edits write) are read on the host at each step,
# so every step runs on the kernel backend.
KERNEL_CASES: list[tuple[str, dict[str, Any]]] = [
    ("Adam", {"weight_decay": 0.1}),
    ("AdamW", {"amsgrad": True, "weight_decay": 0.05}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
]


@pytest.mark.parametrize("case", KERNEL_CASES, ids=[c for c, _ in KERNEL_CASES])
def test_drop_in_steps_on_the_kernels_and_reads_group_edits(
        case: tuple[str, dict[str, Any]]) -> None:
    name, options = case
    launched: list[int] = []
    launch = _backends._launch

    def counted(*args: Any) -> None:
        launched.append(1)
        launch(*args)

    def halved(opt: Any, k: int) -> None:  # (a scheduler's edit before the last step)
        if k == STEPS - 1:
            for group in opt.param_groups:
                group["lr"] *= 0.5

    torch_opt = _run(lambda ps: getattr(torch.optim, name)(ps, **options), False, halved)
    with engine(("kernel", "eager")) as calls, warnings.catch_warnings():
        warnings.simplefilter("error", FastPathWarning)
        _backends._launch = counted  # type: ignore[assignment]
        try:
            found = _run(lambda ps: getattr(O, name)(ps, **options), False, halved)
        finally:
            _backends._launch = launch  # type: ignore[assignment]
    assert len(calls) == STEPS and len(launched) == STEPS, (calls, launched)
    for k, (p, e) in enumerate(zip(found[0], torch_opt[0], strict=True)):
        _fast._assert_fast_close(p, e, e, check="engine vs torch.optim", what=f"{name} {k}",
                                 exact=False)
