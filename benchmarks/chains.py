"""Composed chains as users write them, against the PyTorch step that computes the same.

Each sub-case has its own contenders: the chain on functopt's pure path (the reference the
others are checked against), the same chain through the fast entry point users call
(``make_step(tx, donate=True)``, ``mixed_precision(..., donate=True)``, the facades), and
PyTorch's best step for the same maths. Where PyTorch has no such optimizer (Lion), its
AdamW is timed beside it as the yardstick the target names, and left out of the numerical
check.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import contenders as C
import torch

import functopt

LR, BETAS, EPS, WD, MAX_NORM = C.LR, C.BETAS, C.EPS, C.WEIGHT_DECAY, C.MAX_GRAD_NORM


def _no_decay_mask(params: dict[str, torch.Tensor]) -> dict[str, bool]:
    return {k: p.dim() > 1 for k, p in params.items()}


def _adamw(mask: Any = None) -> functopt.GradientTransformation:
    return functopt.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD, mask=mask)


CHAINS: dict[str, Callable[[], functopt.GradientTransformation]] = {
    "clip_adamw": lambda: functopt.chain(functopt.clip_by_global_norm(MAX_NORM), _adamw()),
    "masked_decay": lambda: _adamw(mask=_no_decay_mask),
    "adam_decay_schedule": lambda: functopt.chain(
        functopt.scale_by_adam(b1=BETAS[0], b2=BETAS[1], eps=EPS),
        functopt.add_decayed_weights(WD),
        functopt.scale_by_learning_rate(functopt.schedules.constant_schedule(LR))),
    "lion": lambda: functopt.lion(LR / 3, weight_decay=WD * 3),
}


class FunctoptChain(C.Contender):
    """A composed chain: pure (``update`` + ``apply_updates``) or ``make_step(donate=True)``,
    the call the README shows; with ``donate_grads``, the gradients handed over too (a
    clip may then scale them in place, as ``clip_grad_norm_`` scales torch's)."""

    def __init__(self, params: list[torch.Tensor], grads: list[torch.Tensor],
                 tx: functopt.GradientTransformation, *, fast: bool,
                 compile: bool = False, one_buffer: bool = False,
                 donate_grads: bool = False) -> None:
        super().__init__()
        self.name = "functopt compiled" if compile else (
            "functopt fused" if fast else "functopt pure")
        if donate_grads:
            self.name += ", donate_grads"
        names = C._names(len(params))
        self.params = {k: p.clone() for k, p in zip(names, params, strict=True)}
        self.grads = {k: g.clone() for k, g in zip(names, grads, strict=True)}
        self.tx, self.fast = tx, fast or compile
        self.step_fn = functopt.fast.make_step(
            tx, donate=True, donate_grads=donate_grads, compile=compile) if self.fast else None
        # a step not handed the gradients must leave them as they were
        self.grads_at_start = [g.clone() for g in self.grads.values()] if (
            self.fast and not donate_grads) else None
        if one_buffer:  # step.lay_out: params and their grads in one buffer per group
            assert self.step_fn is not None and compile
            self.name += ", lay_out"
            for p, g in zip(self.params.values(), self.grads.values(), strict=True):
                p.grad = g
            self.params = self.step_fn.lay_out(self.params)
            self.grads = {k: p.grad for k, p in self.params.items()}
        # the compiled tier's state laid out flat by step.init (values as tx.init's)
        self.state = self.step_fn.init(self.params) if compile else tx.init(self.params)
        self.start = list(self.params.values())
        self.call_s: list[float] = []  # wall time of the first calls (the first compiles)

    def step(self) -> None:
        t0 = time.perf_counter()
        if self.step_fn is None:
            updates, self.state = self.tx.update(self.grads, self.state, self.params)
            self.params = functopt.apply_updates(self.params, updates)
        else:
            with torch.no_grad():
                self.params, self.state = self.step_fn(self.grads, self.state, self.params)
        if self.steps < 3:
            self.call_s.append(time.perf_counter() - t0)
        self.steps += 1

    def result(self) -> list[torch.Tensor]:
        return list(self.params.values())

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"params": list(self.params.values()), "grads": list(self.grads.values()),
                "state": C.state_tensors(self.state)}

    def problems(self) -> list[str]:
        found = []
        if self.fast and not C._same_tensors(list(self.params.values()), self.start):
            found.append(C.NOT_IN_PLACE)
        if self.grads_at_start is not None and not all(
                torch.equal(g, g0) for g, g0 in zip(self.grads.values(), self.grads_at_start,
                                                     strict=True)):
            found.append(f"{self.name}: wrote the gradients it was not handed")
        return found


class FunctoptCaptured(FunctoptChain):
    """``make_step(tx, donate=True).capture(...)`` (CUDA only): the step recorded once as a
    CUDA graph, each step one replay on the same params, gradients and state."""

    def __init__(self, params: list[torch.Tensor], grads: list[torch.Tensor],
                 tx: functopt.GradientTransformation) -> None:
        super().__init__(params, grads, tx, fast=True)
        self.name = "functopt captured"
        assert self.step_fn is not None
        self.captured = self.step_fn.capture(self.grads, self.state, self.params)

    def step(self) -> None:
        self.captured()
        self.steps += 1

    def problems(self) -> list[str]:
        return []  # (the recorded tensors are the params: replays write nothing else)


class TorchAdamWFor(C.TorchAdamW):
    """``AdamW(fused=True)``, with ``clip_grad_norm_`` first, or with a no-decay group."""

    def __init__(self, params: list[torch.Tensor], grads: list[torch.Tensor], *,
                 clip: bool = False, no_decay_group: bool = False, name: str = "torch fused",
                 ) -> None:
        super().__init__(params, grads, fused=True)
        self.name = name
        self.clip = clip
        if no_decay_group:
            decay = [p for p in self.params if p.dim() > 1]
            rest = [p for p in self.params if p.dim() <= 1]
            self.opt = torch.optim.AdamW(
                [{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=LR,
                betas=BETAS, eps=EPS, weight_decay=WD, fused=True)

    def step(self) -> None:
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.params, MAX_NORM, foreach=True)
        self.opt.step()
        self.steps += 1


def chain_contenders(case: str, shapes: list[tuple[int, ...]], seed: int = 0, *,
                     compiled: bool = True) -> tuple[list[C.Contender], list[C.Contender]]:
    """(the contenders checked against each other, the timed-only yardsticks). With
    ``compiled``, the chains the kernels take also with ``compile=True`` and
    ``step.lay_out`` (the compiled tier instead of the kernels)."""
    params, grads = C.make_values(shapes, seed, grad_scale=10.0)  # norms above MAX_NORM
    make = CHAINS[case]
    ours = [FunctoptChain(params, grads, make(), fast=False),
            FunctoptChain(params, grads, make(), fast=True)]
    if case == "clip_adamw":  # (the only chain here whose kernel scales the gradients)
        ours.append(FunctoptChain(params, grads, make(), fast=True, donate_grads=True))
    if compiled and case != "lion":
        ours.append(FunctoptChain(params, grads, make(), fast=True, compile=True,
                                  one_buffer=True))
    if case == "lion":
        # no PyTorch kernel: the compiled tier (make_step(compile=True))
        ours.append(FunctoptChain(params, grads, make(), fast=True, compile=True))
        return ours, [TorchAdamWFor(params, grads, name="torch fused AdamW")]
    torch_one = TorchAdamWFor(params, grads, clip=case == "clip_adamw",
                              no_decay_group=case == "masked_decay")
    return [*ours, torch_one], []


# -- the mixed-precision step, every way a user writes it ----------------------------------

def _loss_scale() -> functopt.LossScale:
    return functopt.dynamic_loss_scale(
        init_scale=C.INIT_SCALE, growth_factor=C.GROWTH_FACTOR,
        backoff_factor=C.BACKOFF_FACTOR, growth_interval=C.GROWTH_INTERVAL)


class FunctoptMixedChain(C.FunctoptMixed):
    """``mixed_precision(chain(clip_by_global_norm(1), adamw), donate=True)``; with
    ``compile``, ``compile=True`` and the params laid out by ``mp.lay_out``."""

    def __init__(self, params: list[torch.Tensor], grads: list[torch.Tensor], *,
                 fused: bool, compile: bool = False) -> None:
        super().__init__(params, grads, fused=fused, compile=compile, max_grad_norm=None,
                         inner=functopt.chain(functopt.clip_by_global_norm(MAX_NORM),
                                              _adamw()))


class FacadeMixed(C.Contender):
    """``MixedPrecisionOptimizer`` over an ``nn.Module``'s bf16 params: one group
    (``adamw`` + ``clip_grad_norm``), or decay / no-decay groups; built with no flag but
    ``compile``, so zeros are not counted (``count_zeros``' default, Megatron's; the idiom
    counts none either); ``count_zeros=True`` counts them."""

    def __init__(self, params: list[torch.Tensor], grads: list[torch.Tensor], *,
                 groups: bool, compile: bool = False, count_zeros: bool = False) -> None:
        super().__init__()
        self.name = ("facade, 2 groups" if groups else "facade, 1 group") + (
            ", compile" if compile else "") + (", count_zeros" if count_zeros else "")
        flags: dict[str, Any] = {"count_zeros": True} if count_zeros else {}
        bf_params, bf_grads = C._bf16_setup(params, grads)
        names = C._names(len(params))
        self.params = [torch.nn.Parameter(p) for p in bf_params]
        for p, g in zip(self.params, bf_grads, strict=True):
            p.grad = g
        named = list(zip(names, self.params, strict=True))

        def factory(learning_rate: float = LR, weight_decay: float = WD,
                    ) -> functopt.GradientTransformation:
            return functopt.adamw(learning_rate, b1=BETAS[0], b2=BETAS[1], eps=EPS,
                                  weight_decay=weight_decay)

        if groups:
            spec: Any = [{"params": [(n, p) for n, p in named if p.dim() > 1]},
                         {"params": [(n, p) for n, p in named if p.dim() <= 1],
                          "wd_mult": 0.0}]
            self.opt = functopt.MixedPrecisionOptimizer(spec, factory,
                                                        loss_scale=_loss_scale(),
                                                        compile=compile, **flags)
        else:
            self.opt = functopt.MixedPrecisionOptimizer(named, _adamw(),
                                                        loss_scale=_loss_scale(),
                                                        compile=compile, **flags)
        self.opt.clip_grad_norm(None, MAX_NORM)
        self.start = list(self.params)

    def step(self) -> None:
        self.opt.step()
        self.steps += 1

    def result(self) -> list[torch.Tensor]:
        state = self.opt.named_state_dict()["state"]
        return [*(state[n]["master"] for n in C._names(len(self.params))),
                torch.tensor([self.opt.loss_scale], device=C.DEVICE)]

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"params": list(self.params)}


def mixed_contenders(case: str, shapes: list[tuple[int, ...]], seed: int = 0, *,
                     compiled: bool = True) -> tuple[list[C.Contender], list[C.Contender]]:
    """(the contenders checked against each other, the timed-only yardsticks). Each way
    as a user writes it, then (``compiled``) with ``compile=True``: the compiled tier's one
    loop writes masters, moments and the bf16 params, laid out in one buffer."""
    params, grads = C.make_values(shapes, seed)
    ref = C.FunctoptMixed(params, grads, fused=False)
    idiom = C.TorchMixedIdiom(params, grads)
    if case == "max_grad_norm":
        ours: list[C.Contender] = [C.FunctoptMixed(params, grads, fused=True)]
        if compiled:
            ours.append(C.FunctoptMixed(params, grads, fused=True, compile=True))
        return [ref, *ours, idiom], []
    if case == "chain_clip":
        ours = [FunctoptMixedChain(params, grads, fused=True)]
        if compiled:
            ours.append(FunctoptMixedChain(params, grads, fused=True, compile=True))
        return [ref, *ours, idiom], []
    groups = case == "facade_2_groups"
    facades: list[C.Contender] = [
        FacadeMixed(params, grads, groups=groups, compile=c)
        for c in ((False, True) if compiled else (False,))]
    # what counting the zeros costs (count_zeros=True; off by default)
    facades.append(FacadeMixed(params, grads, groups=groups, count_zeros=True))
    if case == "facade_1_group":
        return [ref, *facades, idiom], []
    # decay / no-decay groups: the idiom decays the vectors too, so it is the yardstick
    return facades, [idiom]


# -- a small model: the fixed per-step cost -------------------------------------------------

# An MLP of 6 leaves, 6,922 params (32 -> 64 -> 64 -> 10).
SMALL_SHAPES = [(64, 32), (64,), (64, 64), (64,), (10, 64), (10,)]


class FunctoptOptimizerPlain(C.TorchAdamW):
    """``functopt.Optimizer(params, functopt.adamw(...))``: a plain recipe; with ``make``,
    the torch.optim.Optimizer it builds from the params instead."""

    def __init__(self, params: list[torch.Tensor], grads: list[torch.Tensor], *,
                 name: str = "functopt.Optimizer",
                 make: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None,
                 ) -> None:
        C.Contender.__init__(self)
        self.name = name
        self.params = [p.clone() for p in params]
        for p, g in zip(self.params, grads, strict=True):
            p.grad = g.clone()
        self.opt = (functopt.Optimizer(self.params, _adamw()) if make is None
                    else make(self.params))

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"params": self.params}


def _optim_adamw(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """``functopt.optim.AdamW``: torch's AdamW swapped by one import."""
    return functopt.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)


def small_contenders(shapes: list[tuple[int, ...]], seed: int = 0,
                     ) -> dict[str, tuple[list[C.Contender], list[C.Contender]]]:
    params, grads = C.make_values(shapes, seed)
    return {
        "adamw": ([FunctoptChain(params, grads, _adamw(), fast=False),
                   FunctoptChain(params, grads, _adamw(), fast=True),
                   FunctoptOptimizerPlain(params, grads),
                   FunctoptOptimizerPlain(params, grads, name="functopt.optim.AdamW",
                                          make=_optim_adamw),
                   # a CUDA graph of the step (one launch), where there is CUDA
                   *([FunctoptCaptured(params, grads, _adamw())]
                     if C.DEVICE.type == "cuda" else []),
                   TorchAdamWFor(params, grads)], []),
        "mixed": ([C.FunctoptMixed(params, grads, fused=False),
                   FacadeMixed(params, grads, groups=False),
                   C.TorchMixedIdiom(params, grads)], []),
    }


MIXED = ("max_grad_norm", "chain_clip", "facade_1_group", "facade_2_groups")
