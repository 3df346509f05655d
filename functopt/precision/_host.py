"""The mixed step's scalar bookkeeping on the host, where its 0-d tensors live on the CPU.

A small model's step is dominated by its fixed cost: the loss-scale rule, the unpacking of
the gradient statistics, the clip factor and the metrics are some seventy kernels on 0-d
tensors, each a few microseconds on the CPU, where reading a CPU tensor's value costs a
fraction of one. So when those scalars are plain CPU tensors, the fused step reads them
once and computes the same numbers in Python, with float32 roundings made explicit
(`f32`) and int32/int64 wrap-around reproduced (`wrap`), then writes the few 0-d tensors
the state needs. Python floats are IEEE float64: a product, quotient or square root of
two float64 values is correctly rounded in both, and a float32 product is exact in
float64 before its one rounding, so the results are bitwise the tensor arithmetic's
(tests/test_precision_host.py holds them equal, and the rule to
``torch._amp_update_scale_``). On an accelerator nothing here runs: reading a value there
is a synchronisation, so the step stays on the device.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import torch

__all__: list[str] = []

_F32 = struct.Struct("f")  # native size: the C cast to float (round to nearest, inf past the range)
INT32 = 32
INT64 = 64


def f32(x: float) -> float:
    """``x`` rounded to float32, as ``tensor.to(torch.float32)`` rounds a float64 value."""
    value: float = _F32.unpack(_F32.pack(x))[0]
    return value


def wrap(n: int, bits: int) -> int:
    """``n`` as a ``bits``-bit two's complement integer (torch's integer arithmetic wraps)."""
    half = 1 << (bits - 1)
    return ((n + half) % (1 << bits)) - half


def fits_int32(n: int) -> bool:
    return -(1 << 31) <= n < (1 << 31)


def reciprocal(x: float) -> float:
    """``1 / x`` in float64 (IEEE: ``1/0`` is inf of the zero's sign, as torch's)."""
    if x == 0.0:
        return math.copysign(math.inf, x)
    return 1.0 / x


def on_host(*tensors: Any) -> bool:
    """Whether every one of ``tensors`` is a plain CPU tensor (not a DTensor, not a
    ``torch.func`` wrapper, not a subclass), whose value the host reads for free."""
    return torch._C._functorch.maybe_current_level() is None and all(
        type(t) is torch.Tensor and t.is_cpu for t in tensors)  # (is_cpu: a fifth of .device)


def scalar(value: float | int | bool, like: torch.Tensor) -> torch.Tensor:
    """A new 0-d tensor holding ``value`` in ``like``'s dtype and device."""
    return torch.scalar_tensor(value, dtype=like.dtype, device=like.device)


def kept(value: float | int | bool, old: torch.Tensor, reuse: bool) -> torch.Tensor:
    """``old`` itself when it holds ``value`` and may be shared (``reuse``: the caller
    donated the state it comes from), else a new 0-d tensor like it."""
    if reuse:
        held = old.item()
        if held == value and math.copysign(1.0, held) == math.copysign(1.0, value):
            return old  # (the sign test tells -0.0 from 0.0)
    return scalar(value, old)
