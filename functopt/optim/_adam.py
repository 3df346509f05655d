"""Adam and its relatives with torch.optim's names: Adam, AdamW, NAdam, RAdam, Adamax."""

from __future__ import annotations

from typing import Any

import torch

from functopt.adapters._torch_state import TorchLayout
from functopt.optim import _base, _chains

__all__ = ["Adam", "AdamW", "Adamax", "NAdam", "RAdam"]

Betas = tuple[float | torch.Tensor, float | torch.Tensor]


def _check_tensor_options(owner: str, lr: Any, betas: Any, foreach: bool | None,
                          capturable: bool) -> None:
    # torch.optim.Adam's own limits, kept so that code written against them behaves alike.
    if isinstance(lr, torch.Tensor) and foreach and not capturable:
        raise ValueError(f"{owner}: lr as a Tensor is not supported for capturable=False and "
                         f"foreach=True. Fix: pass lr as a float, or drop foreach=True.")
    if isinstance(betas, (tuple, list)) and len(betas) == 2:
        tensors = [isinstance(b, torch.Tensor) for b in betas]
        if tensors[0] != tensors[1]:
            raise ValueError(f"{owner}: betas must be either both floats or both Tensors, got "
                             f"{betas!r}.")
        if tensors[0] and foreach and not capturable:
            raise ValueError(f"{owner}: betas[0] as a Tensor is not supported for "
                             f"capturable=False and foreach=True. Fix: pass floats.")


def _l2(params: Any, weight_decay: Any) -> bool:
    """Whether the chain needs a weight-decay stage: a non-zero decay here or in a group."""
    values = [weight_decay, *_base.groups_set(params, "weight_decay")]
    return any(_base.number("functopt.optim", "weight_decay", v) != 0 for v in values)


class Adam(_base.TorchOptimizer):
    r"""``torch.optim.Adam`` as a functopt chain: the same signature, defaults and numerics.

    The chain is [`functopt.adam`][functopt.adam]'s (``scale_by_adam``,
    ``scale_by_learning_rate``) under ``inject_hyperparams``, so it takes PyTorch's fused
    Adam kernel (see [`functopt.fast.explain`][functopt.fast.explain] on ``opt.transform``).
    ``weight_decay`` adds $\lambda p$ to the gradient first (L2; ``decoupled_weight_decay=True``
    makes it AdamW's); ``amsgrad=True`` uses torch's variant (the maximum of the raw second
    moment, corrected afterwards: ``scale_by_amsgrad(correct_after_max=True)``);
    ``maximize=True`` negates the gradient first (``scale(-1)``). The kernel takes those
    three too (``amsgrad``, ``maximize``, an L2 decay). ``foreach``, ``fused`` and ``capturable`` are hints (``fused=True`` where there is
    no kernel warns); with ``differentiable=True`` the pure chain steps in the autograd
    graph, as torch's does.

    ``lr``, ``betas``, ``eps`` and ``weight_decay`` live in ``param_groups`` (schedulers
    move them, groups may set their own); a group may set its own ``amsgrad``,
    ``maximize`` and ``decoupled_weight_decay`` too (it runs its own chain). With
    ``weight_decay=0`` in the constructor and in every group the chain has no decay stage,
    which keeps the fused kernel.

    Examples:
        >>> import torch, functopt
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = functopt.optim.Adam(model.parameters(), lr=0.1)
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> opt.step()
        >>> opt.param_groups[0]["lr"], opt.param_groups[0]["betas"], opt.param_groups[0]["amsgrad"]
        (0.1, (0.9, 0.999), False)
    """

    # torch's per-param keys -> the chain's state slots (every count is torch's step)
    _sparse_words = "Adam does not support sparse gradients, please consider SparseAdam instead"
    _torch_layout = TorchLayout({
        "exp_avg": ("ScaleByAdamState.mu", "ScaleByAmsgradState.mu"),
        "exp_avg_sq": ("ScaleByAdamState.nu", "ScaleByAmsgradState.nu"),
        "max_exp_avg_sq": ("ScaleByAmsgradState.nu_max",)})

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 1e-3,
        betas: Betas = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool = False,
        compile: bool = False,
    ) -> None:
        owner = f"functopt.optim.{type(self).__name__}"
        _base.check_options(owner, amsgrad=amsgrad, foreach=foreach, maximize=maximize,
                            capturable=capturable, differentiable=differentiable, fused=fused,
                            decoupled_weight_decay=decoupled_weight_decay)
        _check_tensor_options(owner, lr, betas, foreach, capturable)
        _base.check_lr(owner, lr)
        _base.check_nonnegative(owner, eps=eps)
        _base.check_betas(owner, betas)
        _base.check_nonnegative(owner, weight_decay=weight_decay)
        params = _base.listed(params)
        hyper: dict[str, Any] = {"learning_rate": lr, "b1": betas[0], "b2": betas[1],
                                 "eps": eps}
        fixed: dict[str, Any] = {"amsgrad": amsgrad, "maximize": maximize,
                                 "decoupled_weight_decay": decoupled_weight_decay,
                                 "foreach": foreach, "capturable": capturable, "fused": fused}
        decays = decoupled_weight_decay or _l2(params, weight_decay)
        if decays:
            hyper["weight_decay"] = weight_decay
        else:
            fixed["weight_decay"] = weight_decay
        flags = {"decoupled": decoupled_weight_decay, "amsgrad": amsgrad, "maximize": maximize}
        super().__init__(params, _chains.adam, hyper, flags, fixed, lowerable=True,
                         fused=fused, differentiable=differentiable,
                         compile=compile)


class AdamW(Adam):
    r"""``torch.optim.AdamW`` as a functopt chain: the same signature, defaults and numerics.

    [`functopt.adamw`][functopt.adamw]'s chain (``scale_by_adam``,
    ``add_decayed_weights``, ``scale_by_learning_rate``) under ``inject_hyperparams``, with
    torch's default ``weight_decay=1e-2`` (functopt's and optax's ``adamw`` default to
    ``1e-4``); it takes PyTorch's fused AdamW kernel. The options are
    [`Adam`][functopt.optim.Adam]'s, with the decay always decoupled.

    Examples:
        >>> import torch, functopt
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = functopt.optim.AdamW(model.parameters(), lr=1e-3)
        >>> opt.param_groups[0]["weight_decay"]
        0.01
        >>> scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> opt.step()
        >>> scheduler.step()
        >>> opt.param_groups[0]["lr"]
        0.0005
    """

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 1e-3,
        betas: Betas = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        compile: bool = False,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach,
                         maximize=maximize, capturable=capturable,
                         differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True, compile=compile)


class NAdam(_base.TorchOptimizer):
    r"""``torch.optim.NAdam`` as a functopt chain, with Dozat's momentum schedule.

    ``chain([scale(-1)], [add_decayed_weights], scale_by_nadam(b1, b2, eps,
    momentum_decay), [add_decayed_weights], scale_by_learning_rate)``: the decay before the
    moments (L2) or, with ``decoupled_weight_decay=True``, after them. See
    [`functopt.scale_by_nadam`][functopt.scale_by_nadam] (its momentum product is kept in
    float64; torch keeps it in the default dtype). ``lr``, ``betas``, ``eps``,
    ``weight_decay`` and ``momentum_decay`` live in ``param_groups``.

    Examples:
        >>> import torch, functopt
        >>> opt = functopt.optim.NAdam([torch.nn.Parameter(torch.zeros(2))])
        >>> opt.param_groups[0]["lr"], opt.param_groups[0]["momentum_decay"]
        (0.002, 0.004)
    """

    _capturable_words = ("params, mu_products and state_steps", True)

    # torch's per-param keys -> the chain's state slots (every count is torch's step)
    _sparse_words = "NAdam does not support sparse gradients"
    _torch_layout = TorchLayout({
        "mu_product": ("ScaleByNadamState.mu_product",), "exp_avg": ("ScaleByNadamState.mu",),
        "exp_avg_sq": ("ScaleByNadamState.nu",)}, scalars=frozenset({"mu_product"}))

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 2e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        momentum_decay: float = 4e-3,
        decoupled_weight_decay: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        compile: bool = False,
    ) -> None:
        owner = "functopt.optim.NAdam"
        _base.check_options(owner, decoupled_weight_decay=decoupled_weight_decay, foreach=foreach,
                            maximize=maximize, capturable=capturable,
                            differentiable=differentiable)
        _base.check_lr(owner, lr)
        _base.check_nonnegative(owner, eps=eps)
        _base.check_betas(owner, betas)
        _base.check_nonnegative(owner, weight_decay=weight_decay, momentum_decay=momentum_decay)
        params = _base.listed(params)
        hyper: dict[str, Any] = {"learning_rate": lr, "b1": betas[0], "b2": betas[1],
                                 "eps": eps, "momentum_decay": momentum_decay}
        fixed: dict[str, Any] = {"maximize": maximize,
                                 "decoupled_weight_decay": decoupled_weight_decay,
                                 "foreach": foreach, "capturable": capturable}
        if decoupled_weight_decay or _l2(params, weight_decay):
            hyper["weight_decay"] = weight_decay
        else:
            fixed["weight_decay"] = weight_decay
        super().__init__(params, _chains.nadam, hyper,
                         {"decoupled": decoupled_weight_decay, "maximize": maximize}, fixed,
                         lowerable=False, fused=None, differentiable=differentiable,
                         compile=compile)


class RAdam(_base.TorchOptimizer):
    r"""``torch.optim.RAdam`` as a functopt chain.

    ``scale_by_radam(b1, b2, eps, eps_before_correction=True)`` (torch adds ``eps`` to the
    root of the raw second moment), with the decay before it (L2) or, with
    ``decoupled_weight_decay=True``, after it; see
    [`functopt.scale_by_radam`][functopt.scale_by_radam]. ``lr``, ``betas``, ``eps`` and
    ``weight_decay`` live in ``param_groups``.

    Examples:
        >>> import torch, functopt
        >>> p = torch.nn.Parameter(torch.zeros(1))
        >>> opt = functopt.optim.RAdam([p], lr=0.1)
        >>> p.grad = torch.tensor([2.0])
        >>> opt.step()
        >>> p  # the first steps are momentum SGD: -0.1 * 2
        Parameter containing:
        tensor([-0.2000], requires_grad=True)
    """

    # torch's per-param keys -> the chain's state slots (every count is torch's step)
    _sparse_words = "RAdam does not support sparse gradients"
    _torch_layout = TorchLayout({"exp_avg": ("ScaleByAdamState.mu",),
                                 "exp_avg_sq": ("ScaleByAdamState.nu",)})

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        decoupled_weight_decay: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        compile: bool = False,
    ) -> None:
        owner = "functopt.optim.RAdam"
        _base.check_options(owner, decoupled_weight_decay=decoupled_weight_decay, foreach=foreach,
                            maximize=maximize, capturable=capturable,
                            differentiable=differentiable)
        _base.check_lr(owner, lr)
        _base.check_nonnegative(owner, eps=eps)
        _base.check_betas(owner, betas)
        _base.check_nonnegative(owner, weight_decay=weight_decay)
        params = _base.listed(params)
        hyper: dict[str, Any] = {"learning_rate": lr, "b1": betas[0], "b2": betas[1],
                                 "eps": eps}
        fixed: dict[str, Any] = {"maximize": maximize,
                                 "decoupled_weight_decay": decoupled_weight_decay,
                                 "foreach": foreach, "capturable": capturable}
        if decoupled_weight_decay or _l2(params, weight_decay):
            hyper["weight_decay"] = weight_decay
        else:
            fixed["weight_decay"] = weight_decay
        super().__init__(params, _chains.radam, hyper,
                         {"decoupled": decoupled_weight_decay, "maximize": maximize}, fixed,
                         lowerable=False, fused=None, differentiable=differentiable,
                         compile=compile)


class Adamax(_base.TorchOptimizer):
    r"""``torch.optim.Adamax`` as a functopt chain.

    ``chain([scale(-1)], [add_decayed_weights], scale_by_adamax, scale_by_learning_rate)``
    ([`functopt.adamax`][functopt.adamax] with torch's L2 weight decay). ``lr``, ``betas``,
    ``eps`` and ``weight_decay`` live in ``param_groups``.

    Examples:
        >>> import torch, functopt
        >>> p = torch.nn.Parameter(torch.zeros(1))
        >>> opt = functopt.optim.Adamax([p], lr=0.1)
        >>> p.grad = torch.tensor([-3.0])
        >>> opt.step()
        >>> p
        Parameter containing:
        tensor([0.1000], requires_grad=True)
    """

    # torch's per-param keys -> the chain's state slots (every count is torch's step)
    _sparse_words = "Adamax does not support sparse gradients"
    _torch_layout = TorchLayout({"exp_avg": ("ScaleByAdamState.mu",),
                                 "exp_inf": ("ScaleByAdamState.nu",)})

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 2e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        foreach: bool | None = None,
        *,
        maximize: bool = False,
        differentiable: bool = False,
        capturable: bool = False,
        compile: bool = False,
    ) -> None:
        owner = "functopt.optim.Adamax"
        _base.check_options(owner, foreach=foreach, maximize=maximize,
                            differentiable=differentiable, capturable=capturable)
        _base.check_lr(owner, lr)
        _base.check_nonnegative(owner, eps=eps)
        _base.check_betas(owner, betas)
        _base.check_nonnegative(owner, weight_decay=weight_decay)
        params = _base.listed(params)
        hyper: dict[str, Any] = {"learning_rate": lr, "b1": betas[0], "b2": betas[1],
                                 "eps": eps}
        fixed: dict[str, Any] = {"maximize": maximize, "foreach": foreach,
                                 "capturable": capturable}
        if _l2(params, weight_decay):
            hyper["weight_decay"] = weight_decay
        else:
            fixed["weight_decay"] = weight_decay
        super().__init__(params, _chains.adamax, hyper, {"maximize": maximize}, fixed,
                         lowerable=False, fused=None, differentiable=differentiable,
                         compile=compile)
