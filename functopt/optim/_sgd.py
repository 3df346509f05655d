"""SGD and the RMS-scaled rules with torch.optim's names: SGD, RMSprop, Adagrad, Adadelta,
Rprop."""

from __future__ import annotations

from typing import Any

import torch

from functopt.adapters._torch_state import TorchLayout
from functopt.optim import _base, _chains

__all__ = ["SGD", "Adadelta", "Adagrad", "RMSprop", "Rprop"]


def _needed(params: Any, key: str, value: Any) -> bool:
    """Whether a stage is needed: ``value`` or a group's value for ``key`` is non-zero."""
    values = [value, *_base.groups_set(params, key)]
    return any(_base.number("functopt.optim", key, v) != 0 for v in values)


class SGD(_base.TorchOptimizer):
    r"""``torch.optim.SGD`` as a functopt chain: the same signature, defaults and numerics.

    ``chain([scale(-1)], add_decayed_weights(weight_decay), [trace(momentum, nesterov)],
    scale_by_learning_rate(lr))`` under ``inject_hyperparams``: the
    [`functopt.sgd`][functopt.sgd] chain with torch's weight decay, which takes PyTorch's
    fused SGD kernel. With ``dampening`` the momentum is
    [`functopt.dampened_trace`][functopt.dampened_trace]; ``maximize=True`` negates the
    gradient first; the kernel takes both. ``lr``, ``weight_decay`` and ``momentum`` live
    in ``param_groups``; a group may set its own ``dampening``, ``nesterov`` and
    ``maximize`` (it runs its own chain). A
    ``momentum`` of 0 in the constructor and in every group has no stage (the chain keeps
    no momentum buffer, as torch).

    Examples:
        >>> import torch, functopt
        >>> p = torch.nn.Parameter(torch.ones(1))
        >>> opt = functopt.optim.SGD([p], lr=0.1, momentum=0.9)
        >>> for _ in range(2):
        ...     p.grad = torch.ones(1)
        ...     opt.step()
        >>> p  # 1 - 0.1 * 1 - 0.1 * (1 + 0.9)
        Parameter containing:
        tensor([0.7100], requires_grad=True)
    """

    _fused_words = "`fused` does not support sparse grad or complex param"
    # torch's per-param keys -> the chain's state slots (every count is torch's step)
    _torch_layout = TorchLayout(
        {"momentum_buffer": ("TraceState.trace", "DampenedTraceState.trace")}, step=False)

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 1e-3,
        momentum: float = 0,
        dampening: float = 0,
        weight_decay: float | torch.Tensor = 0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | None = None,
        compile: bool = False,
    ) -> None:
        owner = "functopt.optim.SGD"
        _base.check_options(owner, nesterov=nesterov, maximize=maximize, foreach=foreach,
                            differentiable=differentiable, fused=fused)
        _base.check_lr(owner, lr)
        _base.check_nonnegative(owner, momentum=momentum, weight_decay=weight_decay)
        damp = _base.number(owner, "dampening", dampening)
        _base.check(owner, 0.0 <= damp <= 1.0, f"Invalid dampening value: {dampening}",
                    "0 <= dampening <= 1")
        params = _base.listed(params)
        uses_momentum = _needed(params, "momentum", momentum)
        if nesterov and (not uses_momentum or damp != 0):
            raise ValueError(f"{owner}: Nesterov momentum requires a momentum and zero "
                             f"dampening (got momentum={momentum}, dampening={dampening}).")
        hyper: dict[str, Any] = {"learning_rate": lr, "weight_decay": weight_decay}
        fixed: dict[str, Any] = {"dampening": dampening, "nesterov": nesterov,
                                 "maximize": maximize, "foreach": foreach, "fused": fused}
        if uses_momentum:
            hyper["momentum"] = momentum
        else:
            fixed["momentum"] = momentum
        flags = {"dampening": damp, "nesterov": nesterov, "maximize": maximize}
        # torch's fused SGD keeps no buffer for a group whose momentum is 0, where the
        # chain's trace (decay 0) still keeps one: such a group takes the pure path.
        no_buffer = uses_momentum and any(
            _base.number(owner, "momentum", v) == 0
            for v in (momentum, *_base.groups_set(params, "momentum")))
        super().__init__(params, _chains.sgd, hyper, flags, fixed,
                         lowerable=not no_buffer, fused=fused,
                         differentiable=differentiable,
                         compile=compile)

    def state_dict(self) -> dict[str, Any]:
        """torch.optim.SGD's state dict; the momentum buffer of a param that has had sparse
        gradients is sparse, as torch keeps it (torch's Nesterov step adds it to the sparse
        gradient, which a dense buffer cannot be)."""
        saved = super().state_dict()
        seen: dict[int, int] = self.__dict__.get("_sparse_seen", {})
        if seen:
            ids: dict[int, int] = {}
            for group in self.param_groups:
                for p in group["params"]:
                    ids.setdefault(id(p), len(ids))
            for key, dims in seen.items():
                entry = saved["state"].get(ids.get(key, -1))
                if entry is not None and "momentum_buffer" in entry:
                    entry["momentum_buffer"] = entry["momentum_buffer"].to_sparse(dims)
        return saved

    def _sparse_refusal(self, group: dict[str, Any]) -> tuple[str, str] | None:
        # (a sparse gradient is stepped as torch steps it, but by the fused kernel)
        if group.get("fused"):
            return ("`_fused_sgd` does not support sparse gradients",
                    "build the optimizer without fused=True for sparse gradients")
        wd = group.get("weight_decay")
        if wd is not None and float(wd) != 0:  # (torch adds the param to the sparse gradient)
            return ("add(sparse, dense) is not supported. Use add(dense, sparse) instead.",
                    "weight_decay=0 for the group of the sparse params")
        return None


class RMSprop(_base.TorchOptimizer):
    r"""``torch.optim.RMSprop`` as a functopt chain.

    ``chain([scale(-1)], [add_decayed_weights], scale_by_rms or scale_by_stddev (centered)
    with eps outside the root, [trace(momentum)], scale_by_learning_rate)``: the momentum
    accumulates the scaled gradient before the learning rate, as torch. ``lr``, ``alpha``,
    ``eps``, ``weight_decay`` and ``momentum`` live in ``param_groups`` (a zero
    ``momentum`` or ``weight_decay`` in the constructor and every group has no stage); a
    group may set its own ``centered`` and ``maximize``.

    Examples:
        >>> import torch, functopt
        >>> p = torch.nn.Parameter(torch.zeros(1))
        >>> opt = functopt.optim.RMSprop([p], lr=0.01, alpha=0.75, eps=0.0)
        >>> p.grad = torch.tensor([2.0])
        >>> opt.step()
        >>> p  # -0.01 * 2 / sqrt(0.25 * 4)
        Parameter containing:
        tensor([-0.0200], requires_grad=True)
    """

    # torch's per-param keys -> the chain's state slots (every count is torch's step)
    _sparse_words = "RMSprop does not support sparse gradients"
    _torch_layout = TorchLayout({
        "square_avg": ("ScaleByRmsState.nu", "ScaleByRStdDevState.nu"),
        "momentum_buffer": ("TraceState.trace",), "grad_avg": ("ScaleByRStdDevState.mu",)})

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 1e-2,
        alpha: float = 0.99,
        eps: float = 1e-8,
        weight_decay: float = 0,
        momentum: float = 0,
        centered: bool = False,
        capturable: bool = False,
        foreach: bool | None = None,
        maximize: bool = False,
        differentiable: bool = False,
        *,
        compile: bool = False,
    ) -> None:
        owner = "functopt.optim.RMSprop"
        _base.check_options(owner, centered=centered, capturable=capturable, foreach=foreach,
                            maximize=maximize, differentiable=differentiable)
        _base.check_lr(owner, lr)
        _base.check_nonnegative(owner, eps=eps, momentum=momentum, weight_decay=weight_decay,
                                alpha=alpha)
        a = _base.number(owner, "alpha", alpha)
        _base.check(owner, a <= 1.0, f"Invalid alpha value: {alpha}", "0 <= alpha <= 1")
        params = _base.listed(params)
        hyper: dict[str, Any] = {"learning_rate": lr, "alpha": alpha, "eps": eps}
        fixed: dict[str, Any] = {"centered": centered, "maximize": maximize,
                                 "foreach": foreach, "capturable": capturable}
        for key, value in (("weight_decay", weight_decay), ("momentum", momentum)):
            if _needed(params, key, value):
                hyper[key] = value
            else:
                fixed[key] = value
        super().__init__(params, _chains.rmsprop, hyper,
                         {"centered": centered, "maximize": maximize}, fixed,
                         lowerable=False, fused=None, differentiable=differentiable,
                         compile=compile)


class Adagrad(_base.TorchOptimizer):
    r"""``torch.optim.Adagrad`` as a functopt chain.

    ``chain([scale(-1)], [add_decayed_weights], scale_by_rss(initial_accumulator_value,
    eps, eps_in_sqrt=False), scale_by_learning_rate(lr / (1 + (t - 1) lr_decay)))``.
    ``lr``, ``lr_decay``, ``eps``, ``weight_decay`` and ``initial_accumulator_value`` live
    in ``param_groups``; ``maximize`` is fixed. As in torch, every accumulator starts at the
    constructor's ``initial_accumulator_value``: a group's own value is kept, not read.

    Examples:
        >>> import torch, functopt
        >>> p = torch.nn.Parameter(torch.zeros(1))
        >>> opt = functopt.optim.Adagrad([p], lr=0.1, eps=0.0)
        >>> p.grad = torch.tensor([4.0])
        >>> opt.step()
        >>> p
        Parameter containing:
        tensor([-0.1000], requires_grad=True)
    """

    # torch's per-param keys -> the chain's state slots (every count is torch's step)
    _torch_layout = TorchLayout({"sum": ("ScaleByRssState.sum_of_squares",)}, eager=True)
    _eager_state = True  # (torch's constructor makes every param's state)
    _fused_words = "`fused` does not support sparse grad or complex param"

    # torch.optim.Adagrad fills every param's accumulator with the constructor's value; a
    # group's own initial_accumulator_value is kept in the group and read by nothing.
    _init_from_defaults = frozenset({"initial_accumulator_value"})

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 1e-2,
        lr_decay: float = 0,
        weight_decay: float = 0,
        initial_accumulator_value: float = 0,
        eps: float = 1e-10,
        foreach: bool | None = None,
        *,
        maximize: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        compile: bool = False,
    ) -> None:
        owner = "functopt.optim.Adagrad"
        _base.check_options(owner, foreach=foreach, maximize=maximize,
                            differentiable=differentiable, fused=fused)
        _base.check_lr(owner, lr)
        _base.check_nonnegative(owner, lr_decay=lr_decay, weight_decay=weight_decay,
                                initial_accumulator_value=initial_accumulator_value, eps=eps)
        params = _base.listed(params)
        hyper: dict[str, Any] = {"learning_rate": lr, "lr_decay": lr_decay, "eps": eps,
                                 "initial_accumulator_value": initial_accumulator_value}
        fixed: dict[str, Any] = {"maximize": maximize, "foreach": foreach, "fused": fused}
        if _needed(params, "weight_decay", weight_decay):
            hyper["weight_decay"] = weight_decay
        else:
            fixed["weight_decay"] = weight_decay
        super().__init__(params, _chains.adagrad, hyper, {"maximize": maximize}, fixed,
                         lowerable=False, fused=fused, differentiable=differentiable,
                         compile=compile)

    def _sparse_refusal(self, group: dict[str, Any]) -> tuple[str, str] | None:
        if group.get("fused"):
            return ("`fused` does not support sparse grad or complex param",
                    "build the optimizer without fused=True for sparse gradients")
        wd = group.get("weight_decay")
        if wd is not None and float(wd) != 0:
            return ("weight_decay option is not compatible with sparse gradients",
                    "weight_decay=0 for the group of the sparse params")
        return None


class Adadelta(_base.TorchOptimizer):
    r"""``torch.optim.Adadelta`` as a functopt chain.

    ``chain([scale(-1)], [add_decayed_weights], scale_by_adadelta(rho, eps),
    scale_by_learning_rate(lr))`` ([`functopt.adadelta`][functopt.adadelta]). ``lr``,
    ``rho``, ``eps`` and ``weight_decay`` live in ``param_groups``; ``maximize`` is fixed.

    Examples:
        >>> import torch, functopt
        >>> p = torch.nn.Parameter(torch.zeros(1))
        >>> opt = functopt.optim.Adadelta([p], rho=0.5, eps=1e-4)
        >>> p.grad = torch.tensor([1.0])
        >>> opt.step()
        >>> p  # -sqrt(1e-4) / sqrt(0.5 + 1e-4)
        Parameter containing:
        tensor([-0.0141], requires_grad=True)
    """

    _capturable_words = ("params and state_steps", False)

    # torch's per-param keys -> the chain's state slots (every count is torch's step)
    _sparse_words = "Adadelta does not support sparse gradients"
    _torch_layout = TorchLayout({"square_avg": ("ScaleByAdaDeltaState.e_g",),
                                 "acc_delta": ("ScaleByAdaDeltaState.e_x",)})

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 1.0,
        rho: float = 0.9,
        eps: float = 1e-6,
        weight_decay: float = 0,
        foreach: bool | None = None,
        *,
        capturable: bool = False,
        maximize: bool = False,
        differentiable: bool = False,
        compile: bool = False,
    ) -> None:
        owner = "functopt.optim.Adadelta"
        _base.check_options(owner, foreach=foreach, capturable=capturable, maximize=maximize,
                            differentiable=differentiable)
        _base.check_lr(owner, lr)
        r = _base.number(owner, "rho", rho)
        _base.check(owner, 0.0 <= r <= 1.0, f"Invalid rho value: {rho}", "0 <= rho <= 1")
        _base.check_nonnegative(owner, eps=eps, weight_decay=weight_decay)
        params = _base.listed(params)
        hyper: dict[str, Any] = {"learning_rate": lr, "rho": rho, "eps": eps}
        fixed: dict[str, Any] = {"maximize": maximize, "foreach": foreach,
                                 "capturable": capturable}
        if _needed(params, "weight_decay", weight_decay):
            hyper["weight_decay"] = weight_decay
        else:
            fixed["weight_decay"] = weight_decay
        super().__init__(params, _chains.adadelta, hyper, {"maximize": maximize}, fixed,
                         lowerable=False, fused=None, differentiable=differentiable,
                         compile=compile)


class Rprop(_base.TorchOptimizer):
    r"""``torch.optim.Rprop`` as a functopt chain.

    ``chain([scale(-1)], scale_by_rprop(lr, *etas, *step_sizes), scale(-1))``
    ([`functopt.rprop`][functopt.rprop]). ``lr`` is the initial step size (read when a
    group's state is created, as in torch); a group may set its own ``etas``,
    ``step_sizes`` and ``maximize``.

    Examples:
        >>> import torch, functopt
        >>> p = torch.nn.Parameter(torch.zeros(1))
        >>> opt = functopt.optim.Rprop([p], lr=0.1)
        >>> for g in (1.0, 1.0):
        ...     p.grad = torch.tensor([g])
        ...     opt.step()
        >>> p  # -0.1, then -0.1 * 1.2
        Parameter containing:
        tensor([-0.2200], requires_grad=True)
    """

    # torch's per-param keys -> the chain's state slots (every count is torch's step)
    _sparse_words = "Rprop does not support sparse gradients"
    _torch_layout = TorchLayout({"prev": ("ScaleByRpropState.prev_updates",),
                                 "step_size": ("ScaleByRpropState.step_sizes",)})

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 1e-2,
        etas: tuple[float, float] = (0.5, 1.2),
        step_sizes: tuple[float, float] = (1e-6, 50),
        *,
        capturable: bool = False,
        foreach: bool | None = None,
        maximize: bool = False,
        differentiable: bool = False,
        compile: bool = False,
    ) -> None:
        owner = "functopt.optim.Rprop"
        _base.check_options(owner, capturable=capturable, foreach=foreach, maximize=maximize,
                            differentiable=differentiable)
        _base.check_lr(owner, lr)
        minus, plus = (_base.number(owner, "etas", e) for e in etas)
        _base.check(owner, 0.0 < minus < 1.0 < plus, f"Invalid eta values: {etas[0]}, "
                    f"{etas[1]}", "0 < etas[0] < 1 < etas[1]")
        low, high = (_base.number(owner, "step_sizes", s) for s in step_sizes)
        _base.check(owner, 0.0 <= low <= high, f"Invalid step sizes: {step_sizes}",
                    "0 <= step_sizes[0] <= step_sizes[1]")
        hyper: dict[str, Any] = {"learning_rate": lr}
        fixed: dict[str, Any] = {"etas": tuple(etas), "step_sizes": tuple(step_sizes),
                                 "maximize": maximize, "foreach": foreach,
                                 "capturable": capturable}
        flags = {"etas": (minus, plus), "step_sizes": (low, high), "maximize": maximize}
        super().__init__(params, _chains.rprop, hyper, flags, fixed, lowerable=False,
                         fused=None, differentiable=differentiable,
                         compile=compile)
