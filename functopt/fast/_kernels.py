r"""The fused kernels of the recipes (adam, adamw, sgd): one PyTorch kernel call per step.

A recipe such as [`adamw`][functopt.adamw] is a chain of pure transforms: the reference,
readable and differentiable with ``torch.func``. Its step can also be computed by one of
PyTorch's fused multi-tensor kernels (``torch._fused_adamw_``, ``torch._fused_sgd_``),
which read each param, gradient and moment once and write them once. A
[`FusedTransformation`][functopt.fast.FusedTransformation] is the chain (``init`` and
``update`` are exactly the chain's) together with a [`Kernel`][functopt.fast.Kernel] that
computes the same step on the same state, in place. Nothing else changes: the state has
the chain's layout, so a state made by one path steps on the other, saves to the same
checkpoint keys, and an optimizer can move between paths at any step.

The kernel's arithmetic is not the chain's operation for operation (``torch._fused_adamw_``
folds the bias corrections into a step size and applies the weight decay to the param
before the Adam step), so the two paths agree to rounding: in float64, to a relative
$10^{-12}$ (tests/test_fast.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from functopt._base import Schedule
from functopt._collective.dtensor import _rewrap_like, local_tensor
from functopt._kernel import Kernel, KernelResult, differentiated
from functopt.transforms import _common
from functopt.transforms.accumulation import TraceState
from functopt.transforms.moments import ScaleByAdamState
from functopt.transforms.scaling import ScaleByScheduleState
from functopt.tree import _core

__all__ = ["AdamKernel", "SGDKernel", "adam_kernel", "sgd_kernel"]

# The dtypes PyTorch's fused optimizer kernels accept (params, grads and moments alike).
_KERNEL_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
# torch._fused_sgd_ on the CPU skips the update of every full SIMD block of float16 and
# bfloat16 params and writes wrong momentum buffers (pytorch/pytorch#191763, fixed after
# 2.13 by #192545), so SGD takes its kernel on the CPU for these dtypes only.
_SGD_CPU_DTYPES = (torch.float64, torch.float32)


def _fits(v: torch.Tensor, *others: Any) -> bool:
    """``others`` can go into a fused kernel call beside ``v``: same dtype and shape.

    (Tensors on another device make the kernel raise, naming the devices.)
    """
    dtype = v.dtype
    if dtype not in _KERNEL_DTYPES:
        return False
    shape = v.shape
    for x in others:  # a plain loop: this runs per leaf, every step
        if not (isinstance(x, torch.Tensor) and x.dtype == dtype and x.shape == shape):
            return False
    return True


def _python_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _lr_value(lr: float | torch.Tensor | Schedule, lr_state: Any) -> float | torch.Tensor:
    """The learning rate of this step: the schedule at the count it will read."""
    if callable(lr):
        if not isinstance(lr_state, ScaleByScheduleState):
            raise TypeError("a scheduled learning rate needs the chain's ScaleByScheduleState")
        return torch.as_tensor(lr(lr_state.count))
    return lr


def _groups(values: list[Any], grads: list[Any]) -> dict[tuple[torch.device, torch.dtype],
                                                          list[int]]:
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, (v, g) in enumerate(zip(values, grads, strict=True)):
        if v is not None and g is not None:
            groups.setdefault((v.device, v.dtype), []).append(i)
    return groups


def _owned(xs: list[Any], donate: bool) -> list[Any]:
    """The local tensors the kernel writes: ``xs``' own storage when donated, else copies.

    A DTensor contributes its local shard: the kernels are elementwise, so the shards step
    independently (the gradient statistics that need every rank are reduced by the
    caller).
    """
    return [local_tensor(x) if donate else local_tensor(x).clone() for x in xs]


def _scaled_grads(grads: list[Any], grad_scale: torch.Tensor | None, dtype: torch.dtype,
                  device: torch.device, owned: bool,
                  ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """The gradients a kernel call reads, and the float32 ``grad_scale`` it is given.

    The kernels unscale in place, so gradients the caller still owns are copied first.
    They take ``grad_scale`` only in float32; a float64 group is divided here, in float64,
    and the kernel gets no scale.
    """
    g = _owned(grads, owned or grad_scale is None)
    if grad_scale is None:
        return g, None
    if dtype == torch.float64:
        torch._foreach_div_(g, grad_scale.to(device=device, dtype=torch.float64))
        return g, None
    return g, grad_scale.to(device=device, dtype=torch.float32)


def _flag(found_inf: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if found_inf is None else found_inf.to(device=device, dtype=torch.float32)


@dataclass(frozen=True)
class AdamKernel(Kernel):
    """``torch._fused_adamw_`` (``decoupled=True``) or ``torch._fused_adam_`` for
    [`adamw`][functopt.adamw] and [`adam`][functopt.adam] chains."""

    lr: float | torch.Tensor | Schedule
    b1: float
    b2: float
    eps: float
    weight_decay: float
    decoupled: bool  # the chain has add_decayed_weights (adamw) between Adam and the lr

    def accepts(self, values: list[Any], grads: list[Any], state: Any) -> bool:
        return self._moments(values, grads, state) is not None

    def _moments(self, values: list[Any], grads: list[Any], state: Any,
                 ) -> tuple[list[Any], Any, list[Any], Any] | None:
        """The flattened moments (and their specs) when the kernel can take these leaves."""
        if not (isinstance(state, tuple) and state
                and isinstance(state[0], ScaleByAdamState)):
            return None
        if isinstance(self.lr, torch.Tensor) and differentiated(self.lr):
            return None
        mus, mu_spec = _core.flatten(state[0].mu)
        nus, nu_spec = _core.flatten(state[0].nu)
        if len(mus) != len(values) or len(nus) != len(values):
            return None
        # (grads have their values' dtype and shape: the callers check that, naming leaves)
        for v, g, m, n in zip(values, grads, mus, nus, strict=True):
            if v is not None and g is not None and not _fits(v, m, n):
                return None
        return mus, mu_spec, nus, nu_spec

    def run(
        self, values: list[Any], grads: list[Any], state: Any, *, donate: bool,
        grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None,
        donate_grads: bool | None = None,
    ) -> KernelResult | None:
        moments = self._moments(values, grads, state)
        if moments is None:
            return None
        mus, mu_spec, nus, nu_spec = moments
        adam_state, lr_state = state[0], state[-1]
        groups = _groups(values, grads)
        lr = _lr_value(self.lr, lr_state)
        new_values, new_mus, new_nus = list(values), list(mus), list(nus)
        step = _common.safe_increment(adam_state.count)
        kernel = torch._fused_adamw_ if self.decoupled else torch._fused_adam_
        for (device, dtype), idx in groups.items():
            p = _owned([values[i] for i in idx], donate)
            m = _owned([mus[i] for i in idx], donate)
            n = _owned([nus[i] for i in idx], donate)
            g, scale_here = _scaled_grads([grads[i] for i in idx], grad_scale, dtype,
                                          device, donate if donate_grads is None
                                          else donate_grads)
            steps = [step.to(device=device, dtype=torch.float32)] * len(idx)
            # the pure chain multiplies by the lr rounded to the leaves' dtype (float32 at
            # least: the kernel's own arithmetic for half types)
            lr_here = lr.to(device=device, dtype=torch.promote_types(dtype, torch.float32),
                            ) if isinstance(lr, torch.Tensor) else lr
            kernel(p, g, m, n, [], steps, lr=lr_here, beta1=self.b1, beta2=self.b2,
                   weight_decay=self.weight_decay, eps=self.eps, amsgrad=False,
                   maximize=False, grad_scale=scale_here, found_inf=_flag(found_inf, device))
            if not donate:  # donated leaves were written in place: the lists hold them
                for j, i in enumerate(idx):  # new copies, as DTensors where those were
                    new_values[i] = _rewrap_like(values[i], p[j])
                    new_mus[i] = _rewrap_like(mus[i], m[j])
                    new_nus[i] = _rewrap_like(nus[i], n[j])
        new_adam = ScaleByAdamState(
            count=_common.advance(adam_state.count, found_inf),
            mu=_core.unflatten(mu_spec, new_mus), nu=_core.unflatten(nu_spec, new_nus),
        )
        return KernelResult(new_values, (new_adam, *state[1:-1], _advance_lr(lr_state,
                                                                             found_inf)))


@dataclass(frozen=True)
class SGDKernel(Kernel):
    """``torch._fused_sgd_`` for [`sgd`][functopt.sgd] chains (plain, momentum, Nesterov)."""

    lr: float
    momentum: float | None
    nesterov: bool

    def accepts(self, values: list[Any], grads: list[Any], state: Any) -> bool:
        if not (isinstance(state, tuple) and len(state) == 2):
            return False
        if self.momentum is None:
            bufs: list[Any] = list(values)
        else:
            if not isinstance(state[0], TraceState):
                return False
            bufs, _ = _core.flatten(state[0].trace)
            if len(bufs) != len(values):
                return False
        return all(
            v is None or g is None or (_fits(v, b)
                                       and (v.device.type != "cpu"
                                            or v.dtype in _SGD_CPU_DTYPES))
            for v, g, b in zip(values, grads, bufs, strict=True)
        )

    def run(
        self, values: list[Any], grads: list[Any], state: Any, *, donate: bool,
        grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None,
        donate_grads: bool | None = None,
    ) -> KernelResult | None:
        if not self.accepts(values, grads, state):
            return None
        trace_state, lr_state = state
        spec = None
        bufs: list[Any] = [None] * len(values)
        if self.momentum is not None:
            bufs, spec = _core.flatten(trace_state.trace)
        groups = _groups(values, grads)
        new_values, new_bufs = list(values), list(bufs)
        for (device, dtype), idx in groups.items():
            p = _owned([values[i] for i in idx], donate)
            g, scale_here = _scaled_grads([grads[i] for i in idx], grad_scale, dtype,
                                          device, donate if donate_grads is None
                                          else donate_grads)
            b = [] if self.momentum is None else _owned([bufs[i] for i in idx], donate)
            # A zero momentum buffer makes the first step's ``momentum * 0 + g`` exactly
            # the ``buf = g`` of is_first_step, so the chain's zero-initialised trace fits.
            torch._fused_sgd_(p, g, b, weight_decay=0.0, momentum=self.momentum or 0.0,
                              lr=self.lr, dampening=0.0, nesterov=self.nesterov,
                              maximize=False, is_first_step=False, grad_scale=scale_here,
                              found_inf=_flag(found_inf, device))
            if not donate:  # donated leaves were written in place: the lists hold them
                for j, i in enumerate(idx):
                    new_values[i] = _rewrap_like(values[i], p[j])
                    if self.momentum is not None:
                        new_bufs[i] = _rewrap_like(bufs[i], b[j])
        new_trace = trace_state if spec is None else TraceState(_core.unflatten(spec, new_bufs))
        return KernelResult(new_values, (new_trace, _advance_lr(lr_state, found_inf)))


def _advance_lr(lr_state: Any, found_inf: torch.Tensor | None) -> Any:
    if isinstance(lr_state, ScaleByScheduleState):
        return ScaleByScheduleState(count=_common.advance(lr_state.count, found_inf))
    return lr_state


def adam_kernel(lr: Any, b1: Any, b2: Any, eps: Any, eps_root: Any, mu_dtype: Any,
                nesterov: bool, weight_decay: Any, mask: Any, *, decoupled: bool,
                ) -> Kernel | None:
    """The kernel of an adam/adamw recipe, or ``None`` when its options have no fused form."""
    numbers: Sequence[Any] = (b1, b2, eps, weight_decay)
    if (nesterov or mask is not None or mu_dtype is not None or not all(
            _python_number(x) for x in numbers) or not _python_number(eps_root)
            or eps_root != 0 or not _lr_ok(lr)):
        return None
    return AdamKernel(lr=lr, b1=float(b1), b2=float(b2), eps=float(eps),
                      weight_decay=float(weight_decay), decoupled=decoupled)


def sgd_kernel(lr: Any, momentum: Any, nesterov: bool, accumulator_dtype: Any,
               ) -> Kernel | None:
    """The kernel of an sgd recipe, or ``None`` when its options have no fused form."""
    if accumulator_dtype is not None or not _python_number(lr):
        return None
    if momentum is not None and not _python_number(momentum):
        return None
    if momentum == 0:
        # The chain keeps a trace (equal to the gradient) that torch._fused_sgd_ would not
        # write without momentum: leave such a chain on the pure path.
        return None
    return SGDKernel(lr=float(lr), momentum=None if momentum is None else float(momentum),
                     nesterov=nesterov)


def _lr_ok(lr: Any) -> bool:
    if _python_number(lr) or callable(lr):
        return True
    return isinstance(lr, torch.Tensor) and lr.ndim == 0 and lr.is_floating_point()

