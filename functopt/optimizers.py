"""Recipes: popular optimizers as chains of transforms, with no maths of their own.

Each recipe has optax's name, signature, defaults and chain, so that an optax optimizer
ports by changing the import. Where torch.optim has the same algorithm, the recipe matches
it numerically (tested in float64 against ``torch.optim``); the differences in
hyperparameter conventions are listed in each docstring.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, ParamSpec

import torch

from functopt import _validate
from functopt._base import GradientTransformation, Numeric, Params, ScalarOrSchedule, identity
from functopt._spec import SpecifiedTransformation, describe, specified
from functopt.transforms.accumulation import ema, trace
from functopt.transforms.adding import add_decayed_weights
from functopt.transforms.clipping import clip_by_block_rms
from functopt.transforms.combining import chain
from functopt.transforms.factored import scale_by_factored_rms
from functopt.transforms.masking import masked
from functopt.transforms.moments import (
    scale_by_adam,
    scale_by_adamax,
    scale_by_amsgrad,
    scale_by_lion,
    scale_by_radam,
)
from functopt.transforms.rms import scale_by_adadelta, scale_by_rms, scale_by_rss, scale_by_stddev
from functopt.transforms.scaling import scale, scale_by_learning_rate, scale_by_param_block_rms
from functopt.transforms.sign import scale_by_rprop, scale_by_sign
from functopt.transforms.trust_ratio import scale_by_trust_ratio

__all__ = [
    "adadelta",
    "adafactor",
    "adagrad",
    "adam",
    "adamax",
    "adamw",
    "amsgrad",
    "lamb",
    "lars",
    "lion",
    "nadam",
    "nadamw",
    "radam",
    "rmsprop",
    "rprop",
    "sgd",
    "sign_sgd",
]

MaskOrFn = Any | Callable[[Params], Any] | None
"""A pytree of bools shaped like (a prefix of) the params, or ``params -> such a tree``."""


_P = ParamSpec("_P")


class Recipe:
    """Which recipe built a transform, and from which arguments: what ``functopt.Optimizer``
    reads to expose a plain recipe's hyperparameters in its param groups and rebuild it
    when a group changes one. ``arguments`` binds the call (all arguments, defaults
    included) when it is read, so that building a recipe, which ``inject_hyperparams`` does
    at every update, costs no more than before."""

    __slots__ = ("_args", "_kwargs", "factory", "name")

    def __init__(self, name: str, factory: Callable[..., GradientTransformation],
                 args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.name = name
        self.factory = factory
        self._args = args
        self._kwargs = kwargs

    @property
    def arguments(self) -> dict[str, Any]:
        """Every argument of the call by name, defaults included."""
        bound = inspect.signature(self.factory).bind(*self._args, **self._kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)


_RECIPE_ATTRIBUTE = "_functopt_recipe"


def recipe_of(tx: Any) -> Recipe | None:
    """The ``Recipe`` record of a transform a recipe returned (None for any other
    transform, or one rebuilt from it with ``_replace``)."""
    record = getattr(tx, _RECIPE_ATTRIBUTE, None)
    return record if isinstance(record, Recipe) else None


def _recorded(fn: Callable[_P, GradientTransformation]) -> Callable[_P, GradientTransformation]:
    """A recipe whose transforms carry their ``Recipe`` record."""

    @functools.wraps(fn)
    def recipe(*args: _P.args, **kwargs: _P.kwargs) -> GradientTransformation:
        tx = fn(*args, **kwargs)
        if not isinstance(tx, SpecifiedTransformation):
            tx = specified(tx, describe(tx))
        object.__setattr__(tx, _RECIPE_ATTRIBUTE, Recipe(fn.__name__, recipe, args, kwargs))
        return tx

    return recipe


def _check_lr(owner: str, learning_rate: Any) -> None:
    _validate.check_range(owner, "learning_rate", learning_rate, low=0.0, allow_callable=True,
                          hint="Fix: pass a non-negative learning rate; the recipe descends.")


@_recorded
def sgd(
    learning_rate: ScalarOrSchedule,
    momentum: Numeric | None = None,
    nesterov: bool = False,
    accumulator_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    r"""Stochastic gradient descent, with optional (Nesterov) momentum.

    ``chain(trace(momentum, nesterov), scale_by_learning_rate(learning_rate))``:
    $m_t = g_t + \mu m_{t-1}$, $u_t = -\eta\, m_t$ (or
    $-\eta (g_t + \mu m_t)$ with Nesterov). Equals ``torch.optim.SGD`` with
    ``dampening=0`` and ``weight_decay=0``.

    Args:
        learning_rate: step size $\eta$ (a number, 0-d tensor or schedule).
        momentum: $\mu$, or None for plain SGD.
        nesterov: use Nesterov momentum.
        accumulator_dtype: storage dtype of the momentum buffer.

    Examples:
        >>> import torch, functopt
        >>> opt = functopt.sgd(0.1, momentum=0.9)
        >>> params = {"w": torch.tensor([1.0])}
        >>> state = opt.init(params)
        >>> updates, state = opt.update({"w": torch.tensor([2.0])}, state)
        >>> functopt.apply_updates(params, updates)
        {'w': tensor([0.8000])}
    """
    _validate.check_flags("sgd", nesterov=nesterov)
    _check_lr("sgd", learning_rate)
    if nesterov and momentum is None:
        raise ValueError("sgd: nesterov=True needs a momentum. Fix: pass momentum=0.9 (say).")
    return chain(
        trace(decay=momentum, nesterov=nesterov, accumulator_dtype=accumulator_dtype)
        if momentum is not None else identity(),
        scale_by_learning_rate(learning_rate),
    )


@_recorded
def adam(
    learning_rate: ScalarOrSchedule,
    b1: Numeric = 0.9,
    b2: Numeric = 0.999,
    eps: Numeric = 1e-8,
    eps_root: Numeric = 0.0,
    mu_dtype: torch.dtype | None = None,
    *,
    nesterov: bool = False,
) -> GradientTransformation:
    r"""Adam: ``chain(scale_by_adam(...), scale_by_learning_rate(learning_rate))``.

    Equals ``torch.optim.Adam(lr, betas=(b1, b2), eps=eps)``. See
    [`functopt.scale_by_adam`][functopt.scale_by_adam] for the rule.

    Examples:
        >>> import torch, functopt
        >>> opt = functopt.adam(1e-3)
        >>> state = opt.init({"w": torch.zeros(3)})
        >>> updates, state = opt.update({"w": torch.tensor([1.0, -2.0, 0.0])}, state)
        >>> updates["w"]
        tensor([-0.0010,  0.0010,  0.0000])
    """
    _validate.check_flags("adam", nesterov=nesterov)
    _check_lr("adam", learning_rate)
    return chain(
        scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype,
                      nesterov=nesterov),
        scale_by_learning_rate(learning_rate),
    )


@_recorded
def adamw(
    learning_rate: ScalarOrSchedule,
    b1: Numeric = 0.9,
    b2: Numeric = 0.999,
    eps: Numeric = 1e-8,
    eps_root: Numeric = 0.0,
    mu_dtype: torch.dtype | None = None,
    weight_decay: Numeric = 1e-4,
    mask: MaskOrFn = None,
    *,
    nesterov: bool = False,
) -> GradientTransformation:
    r"""AdamW (decoupled weight decay, Loshchilov & Hutter 2019).

    ``chain(scale_by_adam, add_decayed_weights(weight_decay, mask),
    scale_by_learning_rate)``: $u_t = -\eta(\text{adam}_t + \lambda p_{t-1})$. The decay
    is multiplied by the learning rate, as in ``torch.optim.AdamW`` (which this equals);
    note optax's default ``weight_decay=1e-4`` differs from torch's ``1e-2``.

    Examples:
        >>> import torch, functopt
        >>> opt = functopt.adamw(0.1, weight_decay=0.5)
        >>> params = {"w": torch.tensor([2.0])}
        >>> updates, _ = opt.update({"w": torch.tensor([0.0])}, opt.init(params), params)
        >>> updates["w"]  # only the decay: -0.1 * 0.5 * 2
        tensor([-0.1000])
    """
    _validate.check_flags("adamw", nesterov=nesterov)
    _check_lr("adamw", learning_rate)
    return chain(
        scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype,
                      nesterov=nesterov),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )


@_recorded
def nadam(
    learning_rate: ScalarOrSchedule,
    b1: Numeric = 0.9,
    b2: Numeric = 0.999,
    eps: Numeric = 1e-8,
    eps_root: Numeric = 0.0,
    mu_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    r"""NAdam (Dozat 2016): [`adam`][functopt.adam] with ``nesterov=True``.

    Follows optax's NAdam (a fixed $\beta_1$); ``torch.optim.NAdam`` adds a momentum
    decay schedule (``momentum_decay=4e-3``) and so differs.

    Examples:
        >>> import torch, functopt
        >>> opt = functopt.nadam(1e-3)
        >>> updates, _ = opt.update({"w": torch.ones(1)}, opt.init({"w": torch.zeros(1)}))
        >>> updates["w"]  # the look-ahead makes the first step 1.47x Adam's
        tensor([-0.0015])
    """
    return adam(learning_rate, b1, b2, eps, eps_root, mu_dtype, nesterov=True)


@_recorded
def nadamw(
    learning_rate: ScalarOrSchedule,
    b1: Numeric = 0.9,
    b2: Numeric = 0.999,
    eps: Numeric = 1e-8,
    eps_root: Numeric = 0.0,
    mu_dtype: torch.dtype | None = None,
    weight_decay: Numeric = 1e-4,
    mask: MaskOrFn = None,
) -> GradientTransformation:
    """NAdamW: [`adamw`][functopt.adamw] with ``nesterov=True``.

    Examples:
        >>> import torch, functopt
        >>> opt = functopt.nadamw(1e-3, weight_decay=0.0)
        >>> p = {"w": torch.zeros(1)}
        >>> opt.update({"w": torch.ones(1)}, opt.init(p), p)[0]["w"]
        tensor([-0.0015])
    """
    return adamw(learning_rate, b1, b2, eps, eps_root, mu_dtype, weight_decay, mask,
                 nesterov=True)


@_recorded
def amsgrad(
    learning_rate: ScalarOrSchedule,
    b1: Numeric = 0.9,
    b2: Numeric = 0.999,
    eps: Numeric = 1e-8,
    eps_root: Numeric = 0.0,
    mu_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    """AMSGrad (Reddi et al. 2018): ``chain(scale_by_amsgrad, scale_by_learning_rate)``.

    Examples:
        >>> import torch, functopt
        >>> opt = functopt.amsgrad(1e-3)
        >>> opt.update({"w": torch.ones(1)}, opt.init({"w": torch.zeros(1)}))[0]["w"]
        tensor([-0.0010])
    """
    _check_lr("amsgrad", learning_rate)
    return chain(
        scale_by_amsgrad(b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype),
        scale_by_learning_rate(learning_rate),
    )


@_recorded
def lion(
    learning_rate: ScalarOrSchedule,
    b1: Numeric = 0.9,
    b2: Numeric = 0.99,
    mu_dtype: torch.dtype | None = None,
    weight_decay: Numeric = 1e-3,
    mask: MaskOrFn = None,
) -> GradientTransformation:
    r"""Lion (Chen et al. 2023): ``chain(scale_by_lion, add_decayed_weights,
    scale_by_learning_rate)``.

    Examples:
        >>> import torch, functopt
        >>> opt = functopt.lion(1e-4, weight_decay=0.0)
        >>> p = {"w": torch.zeros(2)}
        >>> opt.update({"w": torch.tensor([3.0, -0.1])}, opt.init(p), p)[0]["w"]
        tensor([-1.0000e-04,  1.0000e-04])
    """
    _check_lr("lion", learning_rate)
    return chain(
        scale_by_lion(b1=b1, b2=b2, mu_dtype=mu_dtype),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )


@_recorded
def rmsprop(
    learning_rate: ScalarOrSchedule,
    decay: Numeric = 0.9,
    eps: Numeric = 1e-8,
    initial_scale: Numeric = 0.0,
    eps_in_sqrt: bool = True,
    centered: bool = False,
    momentum: Numeric | None = None,
    nesterov: bool = False,
    bias_correction: bool = False,
) -> GradientTransformation:
    r"""RMSProp (Tieleman & Hinton 2012; centered: Graves 2013).

    ``chain(scale_by_rms or scale_by_stddev, scale_by_learning_rate, trace(momentum))``.
    With ``eps_in_sqrt=False`` and ``initial_scale=0`` this equals ``torch.optim.RMSprop``
    (``alpha=decay``), which adds eps outside the root; optax's default
    (``eps_in_sqrt=True``) adds it inside.

    Examples:
        >>> import torch, functopt
        >>> opt = functopt.rmsprop(0.01, eps_in_sqrt=False, eps=0.0)
        >>> opt.update({"w": torch.tensor([2.0])}, opt.init({"w": torch.zeros(1)}))[0]["w"]
        tensor([-0.0316])
    """
    _validate.check_flags("rmsprop", eps_in_sqrt=eps_in_sqrt, centered=centered,
                          nesterov=nesterov, bias_correction=bias_correction)
    _check_lr("rmsprop", learning_rate)
    if nesterov and momentum is None:
        raise ValueError("rmsprop: nesterov=True needs a momentum. Fix: pass momentum=0.9 (say).")
    kwargs: dict[str, Any] = dict(decay=decay, eps=eps, initial_scale=initial_scale,
                                  eps_in_sqrt=eps_in_sqrt, bias_correction=bias_correction)
    return chain(
        scale_by_stddev(**kwargs) if centered else scale_by_rms(**kwargs),
        scale_by_learning_rate(learning_rate),
        trace(decay=momentum, nesterov=nesterov) if momentum is not None else identity(),
    )


@_recorded
def adagrad(
    learning_rate: ScalarOrSchedule,
    initial_accumulator_value: Numeric = 0.1,
    eps: Numeric = 1e-7,
) -> GradientTransformation:
    r"""Adagrad (Duchi et al. 2011): ``chain(scale_by_rss, scale_by_learning_rate)``.

    Note the conventions differ from ``torch.optim.Adagrad`` (which starts the accumulator
    at 0 and adds ``eps=1e-10`` outside the root); see [`functopt.scale_by_rss`][functopt.scale_by_rss].

    Examples:
        >>> import torch, functopt
        >>> opt = functopt.adagrad(0.1, initial_accumulator_value=0.0, eps=0.0)
        >>> opt.update({"w": torch.tensor([4.0])}, opt.init({"w": torch.zeros(1)}))[0]["w"]
        tensor([-0.1000])
    """
    _check_lr("adagrad", learning_rate)
    return chain(
        scale_by_rss(initial_accumulator_value=initial_accumulator_value, eps=eps),
        scale_by_learning_rate(learning_rate),
    )


@_recorded
def lamb(
    learning_rate: ScalarOrSchedule,
    b1: Numeric = 0.9,
    b2: Numeric = 0.999,
    eps: Numeric = 1e-6,
    eps_root: Numeric = 0.0,
    weight_decay: Numeric = 0.0,
    mask: MaskOrFn = None,
) -> GradientTransformation:
    """LAMB (You et al. 2019): ``chain(scale_by_adam, add_decayed_weights,
    scale_by_trust_ratio, scale_by_learning_rate)``.

    Examples:
        >>> import torch, functopt
        >>> opt = functopt.lamb(0.1)
        >>> p = {"w": torch.tensor([3.0, 4.0])}
        >>> opt.update({"w": torch.tensor([1.0, 1.0])}, opt.init(p), p)[0]["w"]
        tensor([-0.3536, -0.3536])
    """
    _check_lr("lamb", learning_rate)
    return chain(
        scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root),
        add_decayed_weights(weight_decay, mask),
        scale_by_trust_ratio(),
        scale_by_learning_rate(learning_rate),
    )


@_recorded
def lars(
    learning_rate: ScalarOrSchedule,
    weight_decay: Numeric = 0.0,
    weight_decay_mask: MaskOrFn = True,
    trust_coefficient: Numeric = 0.001,
    eps: Numeric = 0.0,
    trust_ratio_mask: MaskOrFn = True,
    momentum: Numeric = 0.9,
    nesterov: bool = False,
) -> GradientTransformation:
    """LARS (You et al. 2017): ``chain(add_decayed_weights, masked(scale_by_trust_ratio),
    scale_by_learning_rate, trace(momentum))``.

    Examples:
        >>> import torch, functopt
        >>> opt = functopt.lars(1.0, trust_coefficient=0.1)
        >>> p = {"w": torch.tensor([3.0, 4.0])}
        >>> opt.update({"w": torch.tensor([0.6, 0.8])}, opt.init(p), p)[0]["w"]
        tensor([-0.3000, -0.4000])
    """
    _validate.check_flags("lars", nesterov=nesterov)
    _check_lr("lars", learning_rate)
    return chain(
        add_decayed_weights(weight_decay, mask=weight_decay_mask),
        masked(scale_by_trust_ratio(trust_coefficient=trust_coefficient, eps=eps),
               trust_ratio_mask),
        scale_by_learning_rate(learning_rate),
        trace(decay=momentum, nesterov=nesterov),
    )


@_recorded
def adafactor(
    learning_rate: ScalarOrSchedule | None = None,
    min_dim_size_to_factor: int = 128,
    decay_rate: Numeric = 0.8,
    decay_offset: int = 0,
    multiply_by_parameter_scale: bool = True,
    clipping_threshold: Numeric | None = 1.0,
    momentum: Numeric | None = None,
    dtype_momentum: torch.dtype = torch.float32,
    weight_decay_rate: Numeric | None = None,
    eps: Numeric = 1e-30,
    factored: bool = True,
    weight_decay_mask: MaskOrFn = None,
) -> GradientTransformation:
    """Adafactor (Shazeer & Stern 2018), as optax composes it.

    ``chain(scale_by_factored_rms, clip_by_block_rms(clipping_threshold),
    scale_by_learning_rate(learning_rate, flip_sign=False), scale_by_param_block_rms(),
    ema(momentum, debias=False), add_decayed_weights(weight_decay_rate), scale(-1))``, each
    optional stage present only when its argument asks for it.

    [`functopt.fast.make_step`][functopt.fast.make_step] and the mixed-precision step run
    it on the planner's per-leaf tier (its factored moments and block rms reduce within a
    leaf; equal to the pure step), DTensor shards included.

    Examples:
        >>> import torch, functopt
        >>> opt = functopt.adafactor(learning_rate=0.1, multiply_by_parameter_scale=False)
        >>> p = {"w": torch.ones(2)}
        >>> opt.update({"w": torch.tensor([2.0, -2.0])}, opt.init(p), p)[0]["w"]
        tensor([-0.1000,  0.1000])
    """
    _validate.check_flags("adafactor",
                          multiply_by_parameter_scale=multiply_by_parameter_scale,
                          factored=factored)
    if learning_rate is not None:
        _check_lr("adafactor", learning_rate)
    stages = [
        scale_by_factored_rms(factored, decay_rate, decay_offset, min_dim_size_to_factor, eps)
    ]
    if clipping_threshold is not None:
        stages.append(clip_by_block_rms(clipping_threshold))
    if learning_rate is not None:
        stages.append(scale_by_learning_rate(learning_rate, flip_sign=False))
    if multiply_by_parameter_scale:
        stages.append(scale_by_param_block_rms())
    if momentum is not None:
        stages.append(ema(momentum, debias=False, accumulator_dtype=dtype_momentum))
    if weight_decay_rate is not None:
        stages.append(add_decayed_weights(weight_decay_rate, mask=weight_decay_mask))
    stages.append(scale(-1))
    return chain(*stages)


@_recorded
def sign_sgd(learning_rate: ScalarOrSchedule) -> GradientTransformation:
    r"""SignSGD (Bernstein et al. 2018): $u_t = -\eta\,\operatorname{sign}(g_t)$.

    Examples:
        >>> import torch, functopt
        >>> opt = functopt.sign_sgd(0.5)
        >>> opt.update({"w": torch.tensor([3.0, -1e-9, 0.0])}, opt.init(None))[0]["w"]
        tensor([-0.5000,  0.5000, -0.0000])
    """
    _check_lr("sign_sgd", learning_rate)
    return chain(scale_by_sign(), scale_by_learning_rate(learning_rate))


@_recorded
def adamax(
    learning_rate: ScalarOrSchedule,
    b1: Numeric = 0.9,
    b2: Numeric = 0.999,
    eps: Numeric = 1e-8,
) -> GradientTransformation:
    """Adamax (Kingma & Ba 2014): ``chain(scale_by_adamax, scale_by_learning_rate)``.

    Equals ``torch.optim.Adamax(lr, betas=(b1, b2), eps=eps)``; see
    [`functopt.scale_by_adamax`][functopt.scale_by_adamax] for the rule.

    Examples:
        >>> import torch, functopt
        >>> opt = functopt.adamax(0.1)
        >>> opt.update({"w": torch.tensor([3.0])}, opt.init({"w": torch.zeros(1)}))[0]["w"]
        tensor([-0.1000])
    """
    _check_lr("adamax", learning_rate)
    return chain(scale_by_adamax(b1=b1, b2=b2, eps=eps), scale_by_learning_rate(learning_rate))


@_recorded
def adadelta(
    learning_rate: ScalarOrSchedule | None = None,
    rho: Numeric = 0.9,
    eps: Numeric = 1e-6,
    weight_decay: Numeric = 0.0,
    weight_decay_mask: MaskOrFn = None,
) -> GradientTransformation:
    """Adadelta (Zeiler 2012): ``chain(add_decayed_weights, scale_by_adadelta,
    scale_by_learning_rate)``.

    With ``learning_rate=None`` the rule's own step is taken (a learning rate of 1, as
    ``torch.optim.Adadelta``'s default). The weight decay is added to the gradient
    (torch.optim.Adadelta's ``weight_decay``).

    Examples:
        >>> import torch, functopt
        >>> opt = functopt.adadelta(rho=0.5, eps=1e-4)
        >>> p = {"w": torch.zeros(1)}
        >>> opt.update({"w": torch.tensor([1.0])}, opt.init(p), p)[0]["w"]
        tensor([-0.0141])
    """
    if learning_rate is not None:
        _check_lr("adadelta", learning_rate)
    return chain(
        add_decayed_weights(weight_decay, weight_decay_mask),
        scale_by_adadelta(rho=rho, eps=eps),
        scale_by_learning_rate(1.0 if learning_rate is None else learning_rate),
    )


@_recorded
def radam(
    learning_rate: ScalarOrSchedule,
    b1: Numeric = 0.9,
    b2: Numeric = 0.999,
    eps: Numeric = 1e-8,
    eps_root: Numeric = 0.0,
    threshold: Numeric = 5.0,
    *,
    nesterov: bool = False,
) -> GradientTransformation:
    """RAdam (Liu et al. 2020): ``chain(scale_by_radam, scale_by_learning_rate)``.

    optax's placement of ``eps`` (inside the bias correction);
    [`functopt.optim.RAdam`][functopt.optim.RAdam] uses torch's.

    Examples:
        >>> import torch, functopt
        >>> opt = functopt.radam(0.1)
        >>> opt.update({"w": torch.tensor([3.0])}, opt.init({"w": torch.zeros(1)}))[0]["w"]
        tensor([-0.3000])
    """
    _validate.check_flags("radam", nesterov=nesterov)
    _check_lr("radam", learning_rate)
    return chain(
        scale_by_radam(b1=b1, b2=b2, eps=eps, eps_root=eps_root, threshold=threshold,
                       nesterov=nesterov),
        scale_by_learning_rate(learning_rate),
    )


@_recorded
def rprop(
    learning_rate: Numeric,
    eta_minus: Numeric = 0.5,
    eta_plus: Numeric = 1.2,
    min_step_size: Numeric = 1e-6,
    max_step_size: Numeric = 50.0,
) -> GradientTransformation:
    """Rprop (Riedmiller & Braun 1993): ``chain(scale_by_rprop, scale(-1))``.

    ``learning_rate`` is the initial step size. Equals ``torch.optim.Rprop(lr, etas=(
    eta_minus, eta_plus), step_sizes=(min_step_size, max_step_size))``.

    Examples:
        >>> import torch, functopt
        >>> opt = functopt.rprop(0.1)
        >>> opt.update({"w": torch.tensor([-3.0])}, opt.init({"w": torch.zeros(1)}))[0]["w"]
        tensor([0.1000])
    """
    return chain(
        scale_by_rprop(learning_rate, eta_minus=eta_minus, eta_plus=eta_plus,
                       min_step_size=min_step_size, max_step_size=max_step_size),
        scale(-1.0),
    )
