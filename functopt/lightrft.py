r"""LightRFT's optimizer names over functopt: ``FSDPadaptOptimizer`` and its offload functions.

A LightRFT training script imports ``FSDPadaptOptimizer``, ``offload_fsdp_optimizer``,
``load_fsdp_optimizer`` and ``DTENSOR_SUPPORTED`` from
``lightrft.strategy.fsdp.fsdp_optimizer``; importing them from here instead keeps the script
as it is. The names take LightRFT's arguments and keep LightRFT's behaviour, including its
clipping at 1.0, which a plain [`MixedPrecisionOptimizer`][functopt.MixedPrecisionOptimizer]
does not do unless asked. The semantics followed are those of LightRFT's
``lightrft/strategy/fsdp/fsdp_optimizer.py`` and ``fsdp_utils.py`` at commit
``8c876fd212985c553a86d75a80d16947b98cb3da``; what functopt does differently is said at each
name, and what it cannot honour raises, saying what to do instead
(docs/coming-from-lightrft.md has the whole table).

Examples:
    >>> import torch
    >>> from functopt.lightrft import FSDPadaptOptimizer
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Linear(4, 1).to(torch.bfloat16)
    >>> optimizer = FSDPadaptOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    >>> optimizer.backward(model(torch.ones(2, 4, dtype=torch.bfloat16)).float().sum())
    >>> optimizer.step()
    True
    >>> optimizer.loss_scale
    tensor([1.])
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from functopt.adapters.mixed_precision_optimizer import MixedPrecisionOptimizer
from functopt.precision.loss_scale import LossScale, static_loss_scale
from functopt.precision.stats import NormClip

__all__ = [
    "DTENSOR_SUPPORTED",
    "LIGHTRFT_CLIP_EPS",
    "FSDPadaptOptimizer",
    "load_fsdp_optimizer",
    "offload_fsdp_optimizer",
]

_OWNER = "FSDPadaptOptimizer"

LIGHTRFT_CLIP_EPS = 1e-6
r"""What LightRFT's clip adds to the global norm: the factor is $1 / \max(1, (\lVert g\rVert +
10^{-6}) / c)$ (``_unscale_and_clip_grads``)."""


def _dtensor_importable() -> bool:
    try:
        import torch.distributed.tensor  # noqa: F401
    except ImportError:
        return False
    return True


DTENSOR_SUPPORTED: bool = _dtensor_importable()
"""Whether ``torch.distributed.tensor`` (DTensor, FSDP2's params) imports, as LightRFT's flag
says. functopt's step reduces DTensor params' statistics over their mesh whenever they are
DTensors; the flag only reports the import."""

# LightRFT's own loss scaler for this optimizer: initial scale 1.0, growth and backoff
# factors 1.0, maximum 1.0, so the scale is 1.0 for ever; an overflow skips the step.
_LIGHTRFT_LOSS_SCALE = static_loss_scale(1.0)

_LIGHTRFT_CHECKPOINT = (
    "{owner}.load_state_dict: this is a LightRFT FSDPadaptOptimizer checkpoint (keys "
    "'grad_scaler', 'base_optim_states', 'flat_fp32_weights'), whose masters are lists per "
    "group index of LightRFT's own layout; it cannot be loaded into functopt's state. Fix: "
    "resume the model weights from it and start the optimizer fresh, or load a checkpoint "
    "that this optimizer's state_dict() wrote."
)


def _lightrft_clip(owner: str, max_norm: Any) -> NormClip | None:
    """LightRFT's clip at ``max_norm`` (0 or None: no clipping, as LightRFT's ``> 0`` test)."""
    if max_norm is not None and (isinstance(max_norm, bool)
                                 or not isinstance(max_norm, (int, float))):
        raise TypeError(f"{owner}: max_norm must be a Python number or None, got "
                        f"{type(max_norm).__name__}.")
    if max_norm is not None and not (math.isfinite(max_norm) and max_norm >= 0):
        raise ValueError(f"{owner}: max_norm must be a finite number >= 0 (0 or None switch "
                         f"clipping off), got {max_norm!r}.")
    return NormClip(float(max_norm), eps=LIGHTRFT_CLIP_EPS) if max_norm else None


class FSDPadaptOptimizer(MixedPrecisionOptimizer):
    r"""LightRFT's mixed-precision optimizer: a torch optimizer's numerics on float32 masters.

    A subclass of [`MixedPrecisionOptimizer`][functopt.MixedPrecisionOptimizer] (so also a
    ``torch.optim.Optimizer``: schedulers, ``torch.distributed.checkpoint`` and the
    frameworks take it) with LightRFT's defaults, rather than a factory: its methods keep
    LightRFT's signatures and results where the facade's differ (``loss_scale`` a tensor,
    ``step()`` clearing the gradients, ``clip_grad_norm(model, max_norm)``). As LightRFT's:

    - the optimizer handed over (``torch.optim.AdamW``, ``Adam``, ``SGD``, ``RMSprop``,
      ``Adagrad``) is translated into the same numerics on float32 masters of the
      bfloat16 params, which after each step are the masters rounded;
    - the loss scale is 1.0 for ever (LightRFT's scaler has initial and maximum scale
      1.0, growth and backoff factors 1.0); a step whose gradients hold an inf or a nan
      is skipped, and ``step()`` returns False;
    - every step clips the unscaled gradients by their global L2 norm at ``max_norm``
      (1.0), by LightRFT's rule: they are multiplied by
      $1 / \max(1, (\lVert g\rVert + 10^{-6}) / \text{max\_norm})$, computed in float64
      ([`NormClip`][functopt.precision.NormClip]), in the step's one
      statistics pass;
    - ``step()`` and a skipped step clear the gradients (``zero_grad()``).

    Args:
        optimizer: the torch optimizer, configured and not stepped (its state does not
            carry over).
        max_norm: the clipping bound of every step; 0 or None switches clipping off
            (LightRFT's clip cannot be switched off; its strategy's ``max_norm`` is a
            separate clip of its own). ``clip_grad_norm(model, max_norm)`` changes it.
        loss_scale: the loss-scale rule; LightRFT's constant 1.0 by default.
        **options: the facade's other keyword options (``fused``, ``process_group``,
            ``replicated``, ``agree_skip``, ``agree_timeout``, ``master_dtype``,
            ``count_zeros``, ``grad_norm_skip_threshold``, ``compile``).

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``, or
            ``return_grad_stats`` is given (LightRFT's ``step()`` returns a bool).

    Examples:
        >>> import torch
        >>> from functopt.lightrft import FSDPadaptOptimizer
        >>> w = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
        >>> opt = FSDPadaptOptimizer(torch.optim.SGD([w], lr=1.0))
        >>> w.grad = torch.tensor([3.0, 4.0], dtype=torch.bfloat16)  # norm 5: clipped to 1
        >>> opt.step()
        True
        >>> w, w.grad
        (Parameter containing:
        tensor([-0.6016, -0.8008], dtype=torch.bfloat16, requires_grad=True), None)
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        max_norm: float | None = 1.0,
        loss_scale: LossScale | None = _LIGHTRFT_LOSS_SCALE,
        **options: Any,
    ) -> None:
        if isinstance(optimizer, MixedPrecisionOptimizer) or not isinstance(
                optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"{_OWNER}: optimizer must be a torch.optim optimizer (such as "
                f"torch.optim.AdamW(model.parameters(), lr=1e-4)), got "
                f"{type(optimizer).__name__}."
            )
        if "return_grad_stats" in options:
            raise TypeError(
                f"{_OWNER}: return_grad_stats is not an option here: LightRFT's step() "
                f"returns a bool. Fix: read get_grad_norm() after the step, or use "
                f"functopt.MixedPrecisionOptimizer(..., return_grad_stats=True)."
            )
        clip = _lightrft_clip(_OWNER, max_norm)
        super().__init__(optimizer, loss_scale=loss_scale, **options)
        self._set_max_grad_norm(clip)

    @property
    def loss_scale(self) -> torch.Tensor:  # type: ignore[override]  # LightRFT's: a tensor
        """The current loss scale, as LightRFT's: a float32 tensor of shape ``(1,)``.

        A view of the state's scale, on its device (no host sync).
        """
        return self.get_loss_scale().reshape(1)

    def step(self, closure: Callable[[], Any] | None = None) -> bool:  # type: ignore[override]
        """The facade's step, then ``zero_grad()`` (LightRFT clears the gradients, also after
        a skipped step); False when the step was skipped."""
        took = super().step(closure)
        self.zero_grad()
        return bool(took)

    def clip_grad_norm(self, model: Any, max_norm: float | None) -> None:  # type: ignore[override]
        """Set the clip of the following steps to ``max_norm`` by LightRFT's rule (0 or
        None: off). ``model`` is not used.

        LightRFT's method ignores both arguments and clips at 1.0 regardless; here the
        call means what it says, so ``clip_grad_norm(model, 1.0)`` is LightRFT's setting.
        """
        del model
        self._set_max_grad_norm(_lightrft_clip(f"{_OWNER}.clip_grad_norm", max_norm))

    def backward_by_grad(self, tensor: torch.Tensor | Sequence[torch.Tensor],
                         grad: torch.Tensor | Sequence[torch.Tensor]) -> None:
        """``torch.autograd.backward(tensor, grad)``, each ``grad`` times the loss scale
        (1.0 by default, which leaves it bitwise; LightRFT does not scale it)."""
        scale = self.get_loss_scale()
        grads = [grad] if isinstance(grad, torch.Tensor) else list(grad)
        torch.autograd.backward(tensor, grad_tensors=[
            g * scale.to(g.device, g.dtype) for g in grads])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The facade's ``load_state_dict``; a LightRFT checkpoint raises (see below).

        Raises:
            ValueError: ``state_dict`` is the dict LightRFT's ``FSDPadaptOptimizer``
                saves (its layout of masters cannot be read into functopt's state).
        """
        if isinstance(state_dict, dict) and {"grad_scaler", "base_optim_states",
                                             "flat_fp32_weights"} <= state_dict.keys():
            raise ValueError(_LIGHTRFT_CHECKPOINT.format(owner=_OWNER))
        super().load_state_dict(state_dict)

    @property
    def optim(self) -> torch.optim.Optimizer:
        """LightRFT's wrapped torch optimizer: not kept (raises ``AttributeError``)."""
        raise AttributeError(
            f"{_OWNER}.optim: functopt translates the torch optimizer into its own step and "
            f"does not keep it. Fix: use the optimizer itself: its param_groups, "
            f"state_dict() and load_state_dict()."
        )

    @property
    def grad_scaler(self) -> Any:
        """LightRFT's ``DynamicGradScaler``: not kept (raises ``AttributeError``)."""
        raise AttributeError(
            f"{_OWNER}.grad_scaler: the loss scale is part of functopt's state. Fix: read "
            f"loss_scale (or get_loss_scale()); choose the rule with loss_scale=... when "
            f"building the optimizer."
        )


def _facade(owner: str, optimizer: Any) -> MixedPrecisionOptimizer:
    if not isinstance(optimizer, MixedPrecisionOptimizer):
        raise TypeError(
            f"{owner}: optimizer must be a functopt FSDPadaptOptimizer or "
            f"MixedPrecisionOptimizer, got {type(optimizer).__name__}. Fix: build it with "
            f"functopt.lightrft.FSDPadaptOptimizer(torch_optimizer); for the state of a "
            f"functional step use functopt.distributed.offload / reload."
        )
    return optimizer


@torch.no_grad()
def offload_fsdp_optimizer(optimizer: MixedPrecisionOptimizer) -> None:
    """Move the optimizer's state (masters, moments, loss scale) to host memory.

    ``optimizer.offload_to_cpu()``, then, as LightRFT, ``torch.cuda.empty_cache()`` when
    CUDA is available, so that other work (generation) gets the memory. Until
    [`load_fsdp_optimizer`][functopt.lightrft.load_fsdp_optimizer], ``step()`` raises. A
    second call while offloaded does nothing.

    Raises:
        TypeError: ``optimizer`` is not a functopt optimizer (LightRFT's function also
            takes a plain torch optimizer; this one does not).

    Examples:
        >>> import torch
        >>> from functopt.lightrft import (FSDPadaptOptimizer, load_fsdp_optimizer,
        ...                                offload_fsdp_optimizer)
        >>> w = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
        >>> opt = FSDPadaptOptimizer(torch.optim.AdamW([w], lr=1e-2))
        >>> offload_fsdp_optimizer(opt)
        >>> load_fsdp_optimizer(opt, "cpu")  # the device of the params
    """
    _facade("offload_fsdp_optimizer", optimizer).offload_to_cpu()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@torch.no_grad()
def load_fsdp_optimizer(optimizer: MixedPrecisionOptimizer,
                        device_id: torch.device | str | int | None = None) -> None:
    """Move an offloaded state back to ``device_id``, bitwise.

    ``optimizer.restore_from_cpu(device_id)``, after ``torch.cuda.empty_cache()`` when CUDA
    is available, as LightRFT. ``device_id`` is an accelerator index (LightRFT's form), a
    device or a str, and must be the params' device; None (the default; LightRFT's is the
    current CUDA device) is that device.

    Raises:
        TypeError: ``optimizer`` is not a functopt optimizer.
        ValueError: ``device_id`` is not the device the state came from (LightRFT's
            function reads the current device instead, whatever is passed).
        RuntimeError: the state is not offloaded (LightRFT's function moves nothing then,
            silently).

    Examples:
        >>> import torch
        >>> from functopt.lightrft import (FSDPadaptOptimizer, load_fsdp_optimizer,
        ...                                offload_fsdp_optimizer)
        >>> w = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
        >>> opt = FSDPadaptOptimizer(torch.optim.AdamW([w], lr=1e-2))
        >>> offload_fsdp_optimizer(opt)
        >>> load_fsdp_optimizer(opt)
        >>> load_fsdp_optimizer(opt)
        Traceback (most recent call last):
        ...
        RuntimeError: MixedPrecisionOptimizer.restore_from_cpu: the state is not offloaded (no offload_to_cpu() since the last restore). Fix: call it once per offload_to_cpu().
    """
    facade = _facade("load_fsdp_optimizer", optimizer)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    facade.restore_from_cpu(device_id)
