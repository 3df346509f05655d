"""The optimizer steps being compared: functopt's paths and PyTorch's best idioms.

functopt runs each step on two paths: the pure reference (``tx.update`` then
``functopt.apply_updates``; ``mixed_precision(..., fused=False)``) and the fast path a
training loop uses (``functopt.fast.make_step(tx, donate=True)``; ``mixed_precision(...,
fused=True, donate=True)``). The compiled tier's contenders are in chains.py.

A contender owns its params, grads and optimizer state, and exposes ``step()`` (one full
optimizer step, nothing else), ``result()`` (the float32 values to compare between
contenders after the timed steps), ``tensors()`` (what it holds between steps, by role,
for the memory accounting) and ``problems()`` (what is wrong with its own result, such as
a fast path that silently fell back to the pure one). Every contender of a case starts
from the same values and is stepped the same number of times, so their results must agree
to rounding.
"""

from __future__ import annotations

import math
from typing import Any

import optree
import torch

import functopt

# Hyperparameters shared by every contender (torch.optim.AdamW's defaults, except the
# weight decay, which is passed explicitly: functopt/optax default to 1e-4, torch to 1e-2).
LR = 1e-3
BETAS = (0.9, 0.999)
EPS = 1e-8
WEIGHT_DECAY = 1e-2
MAX_GRAD_NORM = 1.0
INIT_SCALE = 2.0**16
GROWTH_FACTOR, BACKOFF_FACTOR, GROWTH_INTERVAL = 2.0, 0.5, 2000

# One transformer-like block, cycled until the leaf count is reached: square and
# rectangular matrices (attention, MLP) and vectors (biases, norm scales). Each entry is
# (rows, cols) in units of the hidden size d; cols == 0 means a vector of rows * d.
_BLOCK = [(3, 1), (3, 0), (1, 1), (1, 0), (1, 0), (4, 1), (4, 0), (1, 4), (1, 0), (1, 0)]


def make_shapes(total: int, leaves: int) -> list[tuple[int, ...]]:
    """``leaves`` shapes of a transformer-like model with about ``total`` elements.

    The hidden size ``d`` is the largest with ``sum(numel) <= total`` (at least 1); the
    caller reports the actual count, which is within a few percent of ``total``.
    """
    kinds = [_BLOCK[i % len(_BLOCK)] for i in range(leaves)]
    quad = sum(r * c for r, c in kinds if c)  # coefficient of d*d
    lin = sum(r for r, c in kinds if not c)  # coefficient of d
    d = max(1, int((-lin + math.sqrt(lin * lin + 4 * quad * total)) / (2 * quad)))
    return [(r * d, c * d) if c else (r * d,) for r, c in kinds]


# Where every contender's tensors live (run.py --device sets it before building any).
DEVICE = torch.device("cpu")


def make_values(shapes: list[tuple[int, ...]], seed: int, grad_scale: float = 1.0,
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Float32 params (~N(0, 0.02)) and grads (~N(0, 0.01) * grad_scale), reproducibly
    (drawn on the CPU, then moved to ``DEVICE``)."""
    gen = torch.Generator().manual_seed(seed)
    params = [(torch.randn(s, generator=gen) * 0.02).to(DEVICE) for s in shapes]
    grads = [(torch.randn(s, generator=gen) * (0.01 * grad_scale)).to(DEVICE)
             for s in shapes]
    return params, grads


def _names(n: int) -> list[str]:
    width = len(str(n))
    return [f"layer{i:0{width}d}" for i in range(n)]


def state_tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in optree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


class Contender:
    """Base class: ``steps`` counts the optimizer steps taken."""

    name = "?"

    def __init__(self) -> None:
        self.steps = 0

    def step(self) -> None:
        raise NotImplementedError

    def result(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        """Tensors held between steps, by role: params, grads, state, master, grad_buffers
        (float32 gradient buffers kept from one step to the next)."""
        raise NotImplementedError

    def problems(self) -> list[str]:
        """What is wrong with the contender's own result (empty: nothing), after any step."""
        return []


class OptimizerOver(Contender):
    """A ``torch.optim.Optimizer`` class over params with their gradients set once."""

    def __init__(self, name: str, params: list[torch.Tensor], grads: list[torch.Tensor],
                 cls: Any, **options: Any) -> None:
        super().__init__()
        self.name = name
        self.params = [torch.nn.Parameter(p) for p in params]
        for p, g in zip(self.params, grads, strict=True):
            p.grad = g
        self.opt = cls(self.params, **options)

    def step(self) -> None:
        self.opt.step()
        self.steps += 1

    def result(self) -> list[torch.Tensor]:
        return [p.detach() for p in self.params]

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"params": [p.detach() for p in self.params]}


class TransformOver(Contender):
    """A functopt transform over a dict of params, stepped by its pure update (``fast``
    False) or by ``functopt.fast.make_step(tx, donate=True)``."""

    def __init__(self, name: str, params: list[torch.Tensor], grads: list[torch.Tensor],
                 tx: Any, *, fast: bool) -> None:
        super().__init__()
        self.name = name
        self.params = {f"p{i}": p for i, p in enumerate(params)}
        self.grads = {f"p{i}": g for i, g in enumerate(grads)}
        self.tx = tx
        self.state = tx.init(self.params)
        self.run = functopt.fast.make_step(tx, donate=True) if fast else None

    def step(self) -> None:
        with torch.no_grad():
            if self.run is None:
                u, self.state = self.tx.update(self.grads, self.state, self.params)
                self.params = functopt.apply_updates(self.params, u)
            else:
                self.params, self.state = self.run(self.grads, self.state, self.params)
        self.steps += 1

    def result(self) -> list[torch.Tensor]:
        return list(self.params.values())

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"params": list(self.params.values()), "grads": list(self.grads.values())}


def _params_are_rounded_masters(params: list[torch.Tensor], master: list[torch.Tensor]) -> bool:
    return all(torch.equal(p, m.to(p.dtype)) for p, m in zip(params, master, strict=True))


ROUNDED_MASTERS = "its low-precision params are not its rounded masters"
NOT_IN_PLACE = ("its params (or masters) are not the tensors it started with: a step did not "
                "take the donated fused path")


def _same_tensors(now: list[torch.Tensor], start: list[torch.Tensor]) -> bool:
    """Every tensor is still the one the contender started with.

    A donated fused step writes params, masters and moments in place and returns the same
    tensors; the pure path returns new ones. Holding on to the starting tensors checks
    every step this way at no cost inside the timed steps (one fallback breaks it for good).
    """
    return len(now) == len(start) and all(a is b for a, b in zip(now, start, strict=True))


class FunctoptAdamW(Contender):
    """``functopt.adamw`` on the pure path: ``tx.update`` then ``functopt.apply_updates``."""

    name = "functopt pure"

    def __init__(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        super().__init__()
        names = _names(len(params))
        self.params = {k: p.clone() for k, p in zip(names, params, strict=True)}
        self.grads = {k: g.clone() for k, g in zip(names, grads, strict=True)}
        self.tx = functopt.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS,
                                 weight_decay=WEIGHT_DECAY)
        self.state = self.tx.init(self.params)

    def step(self) -> None:
        updates, self.state = self.tx.update(self.grads, self.state, self.params)
        self.params = functopt.apply_updates(self.params, updates)
        self.steps += 1

    def result(self) -> list[torch.Tensor]:
        return list(self.params.values())

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"params": list(self.params.values()), "grads": list(self.grads.values()),
                "state": state_tensors(self.state)}


class FunctoptFusedAdamW(FunctoptAdamW):
    """``functopt.fast.make_step(adamw, donate=True)`` under ``torch.no_grad()``.

    The step a training loop takes: the fused kernel, params and moments donated (updated
    in place), params and state rebound from what the step returns.
    """

    name = "functopt fused"

    def __init__(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        super().__init__(params, grads)
        self.step_fn = functopt.fast.make_step(self.tx, donate=True)
        self.start = list(self.params.values())

    def step(self) -> None:
        with torch.no_grad():
            self.params, self.state = self.step_fn(self.grads, self.state, self.params)
        self.steps += 1

    def problems(self) -> list[str]:
        return [] if _same_tensors(list(self.params.values()), self.start) else [NOT_IN_PLACE]


class TorchAdamW(Contender):
    """``torch.optim.AdamW(foreach=True)`` or ``(fused=True)``, stepping in place."""

    def __init__(self, params: list[torch.Tensor], grads: list[torch.Tensor], *,
                 fused: bool) -> None:
        super().__init__()
        self.name = "torch fused" if fused else "torch foreach"
        self.params = [p.clone() for p in params]
        for p, g in zip(self.params, grads, strict=True):
            p.grad = g.clone()
        self.opt = torch.optim.AdamW(
            self.params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
            foreach=None if fused else True, fused=True if fused else None,
        )

    def step(self) -> None:
        self.opt.step()
        self.steps += 1

    def result(self) -> list[torch.Tensor]:
        return self.params

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"params": self.params,
                "grads": [p.grad for p in self.params if p.grad is not None],
                "state": [t for s in self.opt.state.values() for t in s.values()
                          if isinstance(t, torch.Tensor)]}


class FunctoptOptimizerAdamW(TorchAdamW):
    """``functopt.Optimizer`` (the ``torch.optim.Optimizer`` adapter) driving
    ``inject_hyperparams(functopt.adamw)``: what a torch.optim user swaps in. It steps the
    params in place like torch's optimizers, through the fused kernel."""

    def __init__(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        Contender.__init__(self)
        self.name = "functopt.Optimizer"
        self.params = [p.clone() for p in params]
        for p, g in zip(self.params, grads, strict=True):
            p.grad = g.clone()
        tx = functopt.inject_hyperparams(functopt.adamw)(
            learning_rate=LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY)
        self.opt = functopt.Optimizer(self.params, tx)

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"params": self.params,
                "grads": [p.grad for p in self.params if p.grad is not None],
                "state": [t for s in self.opt.state.values() for t in s.values()
                          if isinstance(t, torch.Tensor) and t.dim() > 0]}


def _bf16_setup(params: list[torch.Tensor], grads: list[torch.Tensor],
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The model's bfloat16 params, and its bfloat16 grads of the loss scaled by INIT_SCALE."""
    return ([p.to(torch.bfloat16) for p in params],
            [(g * INIT_SCALE).to(torch.bfloat16) for g in grads])


class FunctoptMixed(Contender):
    """``functopt.precision.mixed_precision(adamw, dynamic_loss_scale(), max_grad_norm=1)``.

    bfloat16 params and grads (grads of the scaled loss); the float32 master copy, the
    loss scale and Adam's moments live in the explicit state.

    ``fused=False``: "functopt pure", the reference path (``mixed_precision(...,
    fused=False)``). ``fused=True``: "functopt fused", ``mixed_precision(..., fused=True,
    donate=True)`` called under ``torch.no_grad()``, the step a training loop takes.
    Neither counts zero gradients (``count_zeros`` is off by default: ``metrics.num_zeros``
    stays -1): the PyTorch idiom does not count them either, and counting is one more
    read of the gradients.
    """

    def __init__(self, params: list[torch.Tensor], grads: list[torch.Tensor], *,
                 fused: bool, compile: bool = False,
                 inner: functopt.GradientTransformation | None = None,
                 max_grad_norm: float | None = MAX_GRAD_NORM) -> None:
        super().__init__()
        self.name = ("functopt compiled, lay_out" if compile else
                     "functopt fused" if fused else "functopt pure")
        self.fused = fused or compile
        names = _names(len(params))
        bf_params, bf_grads = _bf16_setup(params, grads)
        self.params = dict(zip(names, bf_params, strict=True))
        self.grads = dict(zip(names, bf_grads, strict=True))
        if inner is None:
            inner = functopt.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS,
                                   weight_decay=WEIGHT_DECAY)
        loss_scale = functopt.dynamic_loss_scale(
            init_scale=INIT_SCALE, growth_factor=GROWTH_FACTOR,
            backoff_factor=BACKOFF_FACTOR, growth_interval=GROWTH_INTERVAL)
        if self.fused:
            self.mp = functopt.precision.mixed_precision(
                inner, loss_scale=loss_scale, max_grad_norm=max_grad_norm, fused=True,
                donate=True, compile=compile)
        else:
            self.mp = functopt.precision.mixed_precision(
                inner, loss_scale=loss_scale, max_grad_norm=max_grad_norm, fused=False)
        if compile:
            # mp.lay_out: each compiled group's params and grads become views of one buffer
            # (as a training loop would call it once on the model's params)
            for p, g in zip(self.params.values(), self.grads.values(), strict=True):
                p.grad = g
            self.params = self.mp.lay_out(self.params)
            self.grads = {k: p.grad for k, p in self.params.items()}
        self.state = self.mp.init(self.params)
        self.start = [*self.params.values(), *self.state.master.values()]

    def step(self) -> None:
        if self.fused:
            with torch.no_grad():
                self.params, self.state = self.mp.step(self.grads, self.state, self.params)
        else:
            self.params, self.state = self.mp.step(self.grads, self.state, self.params)
        self.steps += 1

    def result(self) -> list[torch.Tensor]:
        return [*self.state.master.values(), self.state.loss_scale.scale.reshape(1)]

    def problems(self) -> list[str]:
        found = []
        if not _params_are_rounded_masters(list(self.params.values()),
                                           list(self.state.master.values())):
            found.append(ROUNDED_MASTERS)
        now = [*self.params.values(), *self.state.master.values()]
        if self.fused and not _same_tensors(now, self.start):
            found.append(NOT_IN_PLACE)
        return found

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        master = state_tensors(self.state.master)
        ids = {id(t) for t in master}
        # A donating fused step keeps its float32 casts of the grads between steps, to
        # write the next step's casts into (mp.buffers()); they are held like the idiom's
        # main grads, so they count the same way.
        return {"params": list(self.params.values()), "grads": list(self.grads.values()),
                "master": master,
                "state": [t for t in state_tensors(self.state) if id(t) not in ids],
                "grad_buffers": self.mp.buffers()}


class TorchMixedIdiom(Contender):
    """The best PyTorch idiom for the same step, as GradScaler + Megatron-style masters do it.

    Per step: copy the bfloat16 model grads into persistent float32 main grads
    (``_foreach_copy_``); unscale them and set ``found_inf`` in one fused kernel
    (``_amp_foreach_non_finite_check_and_unscale_``, with ``1/scale`` computed in float64
    as ``GradScaler.unscale_`` does); ``clip_grad_norm_(foreach=True)``; fused AdamW on the
    float32 masters, which skips the step itself when ``optimizer.found_inf`` is set (the
    attribute ``GradScaler.step`` hands to optimizers with ``_step_supports_amp_scaling``,
    so there is no host sync); copy the masters back into the bfloat16 params; and move the
    scale with ``_amp_update_scale_`` as ``GradScaler.update`` does.
    """

    name = "torch idiom"

    def __init__(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        super().__init__()
        self.params, self.grads = _bf16_setup(params, grads)
        self.master = [p.float() for p in self.params]
        self.main_grads = [torch.zeros_like(m) for m in self.master]
        for m, g in zip(self.master, self.main_grads, strict=True):
            m.grad = g
        self.opt = torch.optim.AdamW(self.master, lr=LR, betas=BETAS, eps=EPS,
                                     weight_decay=WEIGHT_DECAY, fused=True)
        self.scale = torch.full((), INIT_SCALE, dtype=torch.float32, device=DEVICE)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=DEVICE)
        self.found_inf = torch.zeros((), dtype=torch.float32, device=DEVICE)
        # Read by the fused kernel, which then skips the step on overflow (GradScaler.step
        # sets this attribute the same way).
        self.opt.found_inf = self.found_inf  # type: ignore[attr-defined]

    def step(self) -> None:
        torch._foreach_copy_(self.main_grads, self.grads)
        self.found_inf.zero_()
        inv_scale = self.scale.double().reciprocal().float()
        torch._amp_foreach_non_finite_check_and_unscale_(self.main_grads, self.found_inf,
                                                         inv_scale)
        torch.nn.utils.clip_grad_norm_(self.master, MAX_GRAD_NORM, foreach=True)
        self.opt.step()
        torch._foreach_copy_(self.params, self.master)
        torch._amp_update_scale_(self.scale, self.growth_tracker, self.found_inf,
                                 GROWTH_FACTOR, BACKOFF_FACTOR, GROWTH_INTERVAL)
        self.steps += 1

    def result(self) -> list[torch.Tensor]:
        return [*self.master, self.scale.reshape(1)]

    def problems(self) -> list[str]:
        return [] if _params_are_rounded_masters(self.params, self.master) else [ROUNDED_MASTERS]

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        state = [t for s in self.opt.state.values() for t in s.values()
                 if isinstance(t, torch.Tensor)]
        return {"params": self.params, "grads": self.grads, "master": self.master,
                "grad_buffers": self.main_grads,
                "state": [*state, self.scale, self.growth_tracker, self.found_inf]}


def adamw_contenders(shapes: list[tuple[int, ...]], seed: int = 0, *,
                     adapter: bool = False) -> list[Contender]:
    """functopt pure (the reference), functopt fused, torch foreach, torch fused, and with
    ``adapter`` functopt.Optimizer."""
    params, grads = make_values(shapes, seed)
    extra: list[Contender] = [FunctoptOptimizerAdamW(params, grads)] if adapter else []
    return [FunctoptAdamW(params, grads), FunctoptFusedAdamW(params, grads), *extra,
            TorchAdamW(params, grads, fused=False), TorchAdamW(params, grads, fused=True)]


def mixed_contenders(shapes: list[tuple[int, ...]], seed: int = 0) -> list[Contender]:
    """functopt pure (the reference), functopt fused, torch idiom."""
    params, grads = make_values(shapes, seed)
    return [FunctoptMixed(params, grads, fused=False), FunctoptMixed(params, grads, fused=True),
            TorchMixedIdiom(params, grads)]

