r"""The fused-step extension of the protocol: a transformation that names a kernel.

A [`GradientTransformation`][functopt.GradientTransformation] is a pair of pure functions.
A [`FusedTransformation`][functopt.fast.FusedTransformation] is the same pair together with
a [`Kernel`][functopt.fast.Kernel]: a fused computation of the same step on the same state
(PyTorch's multi-tensor ``torch._fused_adamw_`` and friends), which the fast entry points
run instead of ``update`` plus ``apply_updates``. The types live here, beside the protocol,
so that transforms of every layer can name a kernel (``inject_hyperparams`` does); the
kernels of the recipes are in ``functopt/fast/_kernels.py``. Re-exported as
``functopt.fast.FusedTransformation``, ``functopt.fast.Kernel`` and
``functopt.fast.KernelResult``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from functopt._base import GradientTransformation
from functopt.tree import _core

__all__ = ["FusedTransformation", "Kernel", "KernelResult", "differentiated"]


@dataclass(frozen=True)
class KernelResult:
    """What a [`Kernel`][functopt.fast.Kernel] returns: the new values and the new chain state.

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.sgd(0.5)
        >>> params = [torch.tensor([1.0, 2.0])]
        >>> result = tx.kernel.run(params, [torch.tensor([2.0, 2.0])], tx.init(params),
        ...                        donate=False)
        >>> result.values
        [tensor([0., 1.])]
    """

    values: list[Any]  # like the values passed in: the updated leaves (None where no grad)
    state: Any  # the chain's state after the step, in the chain's layout


class Kernel:
    """A fused computation of one recipe's step, on that recipe's chain state.

    ``run(values, grads, state, ...)`` updates ``values`` (the params, or the masters of a
    mixed-precision step) by one step of the recipe, leaf lists flattened alike, and
    returns a [`KernelResult`][functopt.fast.KernelResult]. Leaves are grouped by (device,
    dtype) and each group takes one kernel call. ``run`` returns ``None`` when it cannot
    compute these leaves (an unsupported dtype, moments stored in another dtype than the
    params, hyperparameters that are tensors): the caller then takes the pure path.

    Subclasses: the built-in kernels of [`adam`][functopt.adam], [`adamw`][functopt.adamw]
    and [`sgd`][functopt.sgd].

    Examples:
        >>> import functopt
        >>> functopt.adamw(1e-3).kernel
        AdamKernel(lr=0.001, b1=0.9, b2=0.999, eps=1e-08, weight_decay=0.0001, decoupled=True)
    """

    def accepts(self, values: list[Any], grads: list[Any], state: Any) -> bool:
        """Whether [`run`][functopt.fast.Kernel.run] can compute these leaves and state."""
        raise NotImplementedError

    def run(
        self, values: list[Any], grads: list[Any], state: Any, *, donate: bool,
        grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None,
        donate_grads: bool | None = None,
    ) -> KernelResult | None:
        """One step on ``values`` (see the class docstring).

        Args:
            values: the leaves to update (plain tensors: local shards of DTensors), ``None``
                for leaves that are not optimized.
            grads: their gradients, each of its value's dtype and shape, or ``None`` (that
                leaf and its moments are left as they are).
            state: the chain's state.
            donate: the kernel may overwrite ``values``, ``grads`` and the state's tensors
                and return them; otherwise it touches none of them.
            grad_scale: divide every gradient by this 0-d tensor first (unscale and clip
                folded into the kernel). PyTorch's kernels take it in float32; float64
                leaves are divided by it in float64 before the kernel instead.
            found_inf: a 0-d tensor; where it is nonzero the step is skipped: values and
                moments keep their values and the step counters do not move.
            donate_grads: whether the kernel may overwrite ``grads`` (default: ``donate``);
                a caller that made the gradients itself (casts) hands them over alone.
        """
        raise NotImplementedError


def differentiated(*trees: Any) -> bool:
    """Whether a step on these pytrees must stay differentiable: autograd records (grad
    mode on and a tensor that requires grad) or a ``torch.func`` transform is active. The
    fused kernels write in place and have no derivative, so such a step is pure.

    The trees are flattened only when grad mode is on: a training step under
    ``torch.no_grad()`` pays two mode checks.
    """
    if torch._C._functorch.maybe_current_level() is not None:
        return True  # inside torch.func.grad, vmap, ...: every input may be wrapped
    if not torch.is_grad_enabled():
        return False
    return any(isinstance(x, torch.Tensor) and x.requires_grad
               for tree in trees for x in _core.flatten(tree)[0])


class FusedTransformation(GradientTransformation):
    """A [`GradientTransformation`][functopt.GradientTransformation] that also names a fused [`Kernel`][functopt.fast.Kernel] for its step.

    ``init`` and ``update`` are the pure chain's, so it is used like any transform (it is
    still a pair: ``init, update = tx`` works). ``kernel`` is read by the fast entry points,
    [`make_step`][functopt.fast.make_step] and
    [`mixed_precision`][functopt.precision.mixed_precision], which then compute the step
    with one fused kernel call per (device, dtype) group. Built by the recipes; a new
    NamedTuple made from one (``tx._replace(...)``) has ``kernel = None``.

    Examples:
        >>> import functopt
        >>> tx = functopt.adamw(1e-3)
        >>> isinstance(tx, functopt.GradientTransformation), type(tx.kernel).__name__
        (True, 'AdamKernel')
        >>> init, update = tx  # still a pair
    """

    kernel: Kernel | None = None

    def __new__(cls, init: Any, update: Any, kernel: Kernel | None = None,
                ) -> FusedTransformation:
        self = super().__new__(cls, init, update)
        self.kernel = kernel
        return self

    def __repr__(self) -> str:
        return f"FusedTransformation(kernel={self.kernel!r})"
