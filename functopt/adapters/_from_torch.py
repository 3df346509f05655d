"""An existing ``torch.optim`` optimizer as functopt param groups and transform factories.

LightRFT builds ``FSDPadaptOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))``:
the mixed-precision wrapper receives a configured torch optimizer. The facade takes the same
object (Adam, AdamW, SGD, RMSprop, Adagrad) and reads what it needs from it: its param groups (params, names, every numeric
hyperparameter) and its class, which picks the functopt chain of the same numerics
(``functopt/optim/_chains.py``, the chains behind ``functopt.optim``). Each group gets its
own factory, ``inject_hyperparams`` of that chain, so its hyperparameters live in the state
and appear in ``param_groups`` under torch's names, where schedulers move them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from functopt._base import GradientTransformation
from functopt.adapters.optimizer import Optimizer
from functopt.transforms.hyperparams import inject_hyperparams

__all__: list[str] = []

# Execution hints of torch.optim: how torch runs the same maths, so nothing to translate.
_HINTS = ("foreach", "fused", "capturable")

CANNOT_TRANSLATE = (
    "{owner}: cannot translate {name} into a functopt chain; translated are "
    "torch.optim.Adam, AdamW, SGD, RMSprop and Adagrad (and functopt.optim's classes of "
    "those names). Fix: "
    "pass the params and a functopt transform instead, e.g. "
    "MixedPrecisionOptimizer(model.named_parameters(), "
    "functopt.inject_hyperparams(functopt.adamw)(learning_rate=1e-4))."
)


def _adam(learning_rate: Any, b1: Any, b2: Any, eps: Any, weight_decay: Any, *,
          amsgrad: bool = False, maximize: bool = False,
          decoupled_weight_decay: bool = False) -> GradientTransformation:
    """torch.optim.Adam / AdamW under torch's option names."""
    from functopt.optim import _chains  # functopt.optim imports the adapters

    return _chains.adam(learning_rate, b1, b2, eps, weight_decay,
                        decoupled=decoupled_weight_decay, amsgrad=amsgrad, maximize=maximize)


def _sgd(learning_rate: Any, weight_decay: Any, *,
         maximize: bool = False) -> GradientTransformation:
    """torch.optim.SGD without momentum (torch skips the buffer when momentum is 0)."""
    from functopt.optim import _chains

    return _chains.sgd(learning_rate, weight_decay, None, maximize=maximize)


def _sgd_momentum(learning_rate: Any, weight_decay: Any, momentum: Any, *,
                  dampening: float = 0.0, nesterov: bool = False,
                  maximize: bool = False) -> GradientTransformation:
    """torch.optim.SGD with a momentum buffer."""
    from functopt.optim import _chains

    return _chains.sgd(learning_rate, weight_decay, momentum, dampening=dampening,
                       nesterov=nesterov, maximize=maximize)


def _rmsprop(learning_rate: Any, alpha: Any, eps: Any, weight_decay: Any, *,
             centered: bool = False, maximize: bool = False) -> GradientTransformation:
    """torch.optim.RMSprop without momentum."""
    from functopt.optim import _chains

    return _chains.rmsprop(learning_rate, alpha, eps, weight_decay, None, centered=centered,
                           maximize=maximize)


def _rmsprop_momentum(learning_rate: Any, alpha: Any, eps: Any, weight_decay: Any,
                      momentum: Any, *, centered: bool = False,
                      maximize: bool = False) -> GradientTransformation:
    """torch.optim.RMSprop with a momentum buffer."""
    from functopt.optim import _chains

    return _chains.rmsprop(learning_rate, alpha, eps, weight_decay, momentum,
                           centered=centered, maximize=maximize)


def _adagrad(learning_rate: Any, lr_decay: Any, initial_accumulator_value: Any, eps: Any,
             weight_decay: Any, *, maximize: bool = False) -> GradientTransformation:
    """torch.optim.Adagrad."""
    from functopt.optim import _chains

    return _chains.adagrad(learning_rate, lr_decay, initial_accumulator_value, eps,
                           weight_decay, maximize=maximize)


_ADAM = inject_hyperparams(_adam)
_RMSPROP = inject_hyperparams(_rmsprop)
_RMSPROP_MOMENTUM = inject_hyperparams(_rmsprop_momentum)
_ADAGRAD = inject_hyperparams(_adagrad)
_SGD = inject_hyperparams(_sgd)
# dampening chooses the stage (dampened_trace or trace): a Python number, not injected.
_SGD_MOMENTUM = inject_hyperparams(_sgd_momentum, static_args="dampening")


def _adam_group(group: dict[str, Any], decoupled: bool) -> tuple[Callable[..., Any],
                                                                dict[str, Any]]:
    b1, b2 = group["betas"]
    options = {"learning_rate": group["lr"], "b1": b1, "b2": b2, "eps": group["eps"],
               "weight_decay": group["weight_decay"], "amsgrad": bool(group["amsgrad"]),
               "maximize": bool(group["maximize"]),
               "decoupled_weight_decay": decoupled or bool(
                   group.get("decoupled_weight_decay", False))}
    return _ADAM, options


def _sgd_group(group: dict[str, Any]) -> tuple[Callable[..., Any], dict[str, Any]]:
    options: dict[str, Any] = {"learning_rate": group["lr"],
                               "weight_decay": group["weight_decay"],
                               "maximize": bool(group["maximize"])}
    if group["momentum"] == 0:
        return _SGD, options
    return _SGD_MOMENTUM, {**options, "momentum": group["momentum"],
                           "dampening": float(group["dampening"]),
                           "nesterov": bool(group["nesterov"])}


def _rmsprop_group(group: dict[str, Any]) -> tuple[Callable[..., Any], dict[str, Any]]:
    options: dict[str, Any] = {"learning_rate": group["lr"], "alpha": group["alpha"],
                               "eps": group["eps"], "weight_decay": group["weight_decay"],
                               "centered": bool(group["centered"]),
                               "maximize": bool(group["maximize"])}
    if group["momentum"] == 0:
        return _RMSPROP, options
    return _RMSPROP_MOMENTUM, {**options, "momentum": group["momentum"]}


def _adagrad_group(group: dict[str, Any]) -> tuple[Callable[..., Any], dict[str, Any]]:
    return _ADAGRAD, {"learning_rate": group["lr"], "lr_decay": group["lr_decay"],
                      "initial_accumulator_value": group["initial_accumulator_value"],
                      "eps": group["eps"], "weight_decay": group["weight_decay"],
                      "maximize": bool(group["maximize"])}


# What each group key of the translated classes becomes; a key outside these sets is
# refused (it would change the maths without a stage reading it).
_READ = {
    "Adam": {"params", "param_names", "lr", "betas", "eps", "weight_decay", "amsgrad",
             "maximize", "decoupled_weight_decay", "differentiable", *_HINTS},
    "SGD": {"params", "param_names", "lr", "momentum", "dampening", "weight_decay",
            "nesterov", "maximize", "differentiable", *_HINTS},
}
_READ["AdamW"] = _READ["Adam"]
_READ["RMSprop"] = {"params", "param_names", "lr", "alpha", "eps", "weight_decay", "momentum",
                    "centered", "maximize", "differentiable", *_HINTS}
_READ["Adagrad"] = {"params", "param_names", "lr", "lr_decay", "initial_accumulator_value",
                    "eps", "weight_decay", "maximize", "differentiable", *_HINTS}


_MULTIPLIERS = ("lr_mult", "wd_mult")


def translate(
    owner: str, optimizer: torch.optim.Optimizer, bookkeeping: frozenset[str]
) -> list[tuple[dict[str, Any], Callable[..., GradientTransformation]]]:
    """``(group dict for _param_groups.collect, factory)`` per param group of ``optimizer``.

    The group dicts name their options by the factories' argument names; params keep the
    names torch holds (``param_names``), else they are numbered as torch numbers them.

    Raises:
        TypeError: naming the class, when it is not one of the translated ones.
        ValueError: the optimizer has state (it has stepped), a group sets an option the
            translation does not read, or ``differentiable=True``.
    """
    cls = type(optimizer)
    name = cls.__name__
    torch_class = getattr(torch.optim, name, None)
    ours = cls.__module__.startswith("functopt.optim")
    if name not in _READ or not (cls is torch_class or ours):
        raise TypeError(CANNOT_TRANSLATE.format(owner=owner,
                                                name=f"{cls.__module__}.{cls.__qualname__}"))
    # (Adagrad makes its state at construction, with step 0: not stepped yet. A
    # functopt.optim group has stepped once it left the state add_param_group planned, or
    # was loaded.)
    if isinstance(optimizer, Optimizer):
        stepped = any(optimizer._stepped(i, g) for i, g in enumerate(optimizer.param_groups))
    else:
        stepped = any(entry and float(entry.get("step", 1)) > 0
                      for entry in optimizer.state.values())
    if stepped:
        raise ValueError(
            f"{owner}: the {name} optimizer has state (it has stepped); its state does not "
            f"carry over into functopt's. Fix: build the torch optimizer and hand it over "
            f"before the first step."
        )
    out = []
    for i, group in enumerate(optimizer.param_groups):
        unread = sorted(k for k in group if k not in _READ[name] and k not in bookkeeping
                        and k not in _MULTIPLIERS)
        if unread:
            raise ValueError(
                f"{owner}: param_groups[{i}] of the {name} optimizer sets {unread}, which the "
                f"translation into a functopt chain does not read. Fix: remove them, or "
                f"pass a functopt transform that uses them."
            )
        if group.get("differentiable"):
            raise ValueError(
                f"{owner}: param_groups[{i}] of the {name} optimizer has differentiable=True; "
                f"the mixed-precision step writes the params in place under no_grad. Fix: "
                f"build it with differentiable=False."
            )
        if name in ("Adam", "AdamW"):
            factory, options = _adam_group(group, decoupled=name == "AdamW")
        else:
            factory, options = {"SGD": _sgd_group, "RMSprop": _rmsprop_group,
                                "Adagrad": _adagrad_group}[name](group)
        names = group.get("param_names")
        params = list(group["params"])
        spec: dict[str, Any] = {
            "params": params if names is None else list(zip(names, params, strict=True)),
            **options,
            **{k: group[k] for k in bookkeeping if k in group},
            # Megatron's multipliers, read by the facade itself
            **{k: group[k] for k in _MULTIPLIERS if k in group},
        }
        out.append((spec, factory))
    return out
