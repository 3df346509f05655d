"""Hyperparameters that live in the state: ``inject_hyperparams``."""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch

from functopt._base import (
    GradientTransformation,
    Params,
    State,
    Updates,
    with_extra_args_support,
)
from functopt._spec import Injected, specified
from functopt._validate import _is_number
from functopt.transforms import _common
from functopt.tree import _core

__all__ = ["InjectHyperparamsState", "inject_hyperparams"]

_OWNER = "inject_hyperparams"


class InjectHyperparamsState(NamedTuple):
    """State of a transform built by [`inject_hyperparams`][functopt.inject_hyperparams].

    ``hyperparams`` holds the value each injected hyperparameter had in the last update
    (after ``init``: the value the first update will use). Assign a new value to a constant
    one between updates to change the next update; a scheduled one is recomputed from
    ``count`` on every update, so assigning to it has no effect.
    """

    # The name shadows tuple.count (hence the ignore); kept: optax's name, public API.
    count: torch.Tensor  # type: ignore[assignment]  # int32, shape (): updates done so far
    hyperparams: dict[str, torch.Tensor]  # name -> 0-d tensor (float64 for Python numbers)
    inner_state: State  # the inner transform's state


def _declared_int(parameter: inspect.Parameter, hints: dict[str, Any]) -> bool:
    """Whether a factory parameter is declared as an int or bool (by annotation or default).

    Such parameters make structural choices (a size, a flag); injecting them as tensors
    would break the factory, so an int passed for one stays a Python int. A parameter whose
    annotation also admits floats or tensors (``Numeric``) is not counted.
    """
    annotation = hints.get(parameter.name, parameter.annotation)
    if annotation is inspect.Parameter.empty:
        return isinstance(parameter.default, int)
    if isinstance(annotation, str):
        members = {part.strip() for part in annotation.split("|")} - {"None"}
        return bool(members) and members <= {"int", "bool"}
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = set(typing.get_args(annotation)) - {type(None)}
    else:
        members = {annotation}
    return bool(members) and members <= {int, bool}


def _type_hints(fn: Callable[..., Any]) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn)
    except Exception:  # unresolvable annotations: fall back to their strings
        return {}


def _first_value(factory: str, arg: str, schedule: Callable[[Any], Any], zero: torch.Tensor,
                 ) -> Any:
    """``schedule(0)``, checked to be a number or a 0-d tensor (a callable that is not a
    schedule, such as a mask function, must be named in ``static_args``)."""
    fix = (f"If {arg!r} is not a schedule, name it in static_args: "
           f"inject_hyperparams({factory}, static_args={arg!r}).")
    try:
        value = schedule(zero)
    except Exception as error:
        raise TypeError(
            f"{_OWNER}({factory}): the callable passed as {arg!r} is taken for a schedule, but "
            f"calling it with the step count (a 0-d int32 tensor) failed: "
            f"{type(error).__name__}: {error}. {fix}"
        ) from error
    if not (_is_number(value) or (isinstance(value, torch.Tensor) and value.dim() == 0)):
        raise TypeError(
            f"{_OWNER}({factory}): the callable passed as {arg!r} is taken for a schedule, but "
            f"at step 0 it returned {type(value).__name__}, not a number or a 0-d tensor. {fix}"
        )
    return value


def inject_hyperparams(
    inner_factory: Callable[..., GradientTransformation],
    static_args: str | Iterable[str] = (),
    hyperparam_dtype: torch.dtype | None = None,
) -> Callable[..., GradientTransformation]:
    r"""Turn a transform factory's numeric arguments into state that can change step to step.

    ``inject_hyperparams(factory)(**args)`` builds a transform whose state,
    [`InjectHyperparamsState`][functopt.InjectHyperparamsState], holds each numeric hyperparameter as a 0-d tensor in
    ``state.hyperparams``. Every update rebuilds ``factory(**args)`` from those tensors, so:

    - a schedule given for a hyperparameter (any callable not named in ``static_args``) is
      evaluated at the state's ``count`` on each update, and the value used is recorded in
      ``state.hyperparams``;
    - a constant can be edited between updates (``state.hyperparams["learning_rate"] =
      torch.tensor(1e-4, dtype=torch.float64)``, or ``functopt.tree.set(state,
      learning_rate=...)``) and the next update uses it; as the value is a tensor, nothing
      recompiles under ``torch.compile``;
    - a tensor hyperparameter keeps its autograd graph, so meta-gradients flow through it
      (under ``torch.func.grad`` too).

    Which arguments are injected (as in optax): ``bool`` arguments, arguments named in
    ``static_args``, and Python ``int`` values of parameters declared ``int``/``bool`` stay
    as they are, as does every value that is not a number, a tensor or a callable. The rest
    is injected.

    Storage dtype (a deliberate difference from optax, which stores in the params' highest
    dtype): Python numbers are stored as float64 0-d tensors on the params' device, and
    tensors keep their dtype, unless ``hyperparam_dtype`` is given, which then applies to
    every floating hyperparameter. Float64 keeps ``1 - b1`` or ``b1 ** t`` as exact as with
    the Python number, and the built-in transforms cast every such scalar to the dtype their
    leaf maths runs in before it meets a leaf (so it promotes no leaf, 0-d ones included):
    on the CPU an injected built-in transform is bitwise equal to the same transform built
    from Python numbers (one exception: ``add_decayed_weights`` takes a Python number
    through torch.optim's fused ``add(alpha=)``, a tensor as a product and a sum). A factory
    of your own should do the same (a 0-d float64 tensor would otherwise run a 0-d float32
    leaf's maths in float64). On an accelerator a device 0-d tensor is not a CPU scalar, and
    a kernel may round it to a bfloat16/float16 leaf's dtype where a Python number keeps
    float32 precision; pass the hyperparameters as CPU tensors (which are kept where they
    are) if that last bit matters.

    The factory is called once when the transform is built, with the values as given and
    schedules evaluated at step 0, so that its argument checks run on the Python numbers.

    Args:
        inner_factory: a function returning a [`GradientTransformation`][functopt.GradientTransformation],
            such as ``functopt.adam`` or a factory of your own; it must accept 0-d tensors
            for the hyperparameters that get injected.
        static_args: names of arguments never to inject (needed for callables that are
            not schedules).
        hyperparam_dtype: the floating dtype to store hyperparameters in (default: float64
            for Python numbers, a tensor's own dtype for tensors).

    Returns:
        A factory with ``inner_factory``'s signature that builds the injected transform.

    Examples:
        >>> import torch, functopt
        >>> def sgd(learning_rate):
        ...     return functopt.scale_by_learning_rate(learning_rate)
        >>> tx = functopt.inject_hyperparams(sgd)(learning_rate=0.1)
        >>> state = tx.init({"w": torch.zeros(1)})
        >>> state.hyperparams["learning_rate"]
        tensor(0.1000, dtype=torch.float64)
        >>> state.hyperparams["learning_rate"] = torch.tensor(0.5, dtype=torch.float64)
        >>> tx.update({"w": torch.ones(1)}, state)[0]
        {'w': tensor([-0.5000])}
    """
    static, signature, name = _check_arguments(inner_factory, static_args, hyperparam_dtype)
    hints = _type_hints(inner_factory)

    @functools.wraps(inner_factory)
    def wrapped_factory(*args: Any, **kwargs: Any) -> GradientTransformation:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as error:
            raise TypeError(f"{_OWNER}({name}): {error}. Its signature is {signature}.") from None
        bound.apply_defaults()
        kinds: dict[str, dict[str, Any]] = {"static": {}, "numeric": {}, "schedule": {}}
        for arg, value in bound.arguments.items():
            kind, value = _kind_of(name, signature.parameters[arg], value, static, hints)
            kinds[kind][arg] = value
        return _injected(inner_factory, name, hyperparam_dtype, other=kinds["static"],
                         numeric=kinds["numeric"], schedules=kinds["schedule"])

    return wrapped_factory


def _check_arguments(
    inner_factory: Any, static_args: str | Iterable[str], hyperparam_dtype: Any
) -> tuple[set[str], inspect.Signature, str]:
    """The names in ``static_args``, the factory's signature and its name, once the
    arguments of ``inject_hyperparams`` are checked."""
    if not callable(inner_factory):
        raise TypeError(
            f"{_OWNER}: inner_factory must be a transform factory such as functopt.adam, got "
            f"{type(inner_factory).__name__}. Fix: pass the factory itself, not a transform."
        )
    static = {static_args} if isinstance(static_args, str) else {*static_args}
    if hyperparam_dtype is not None and (
        not isinstance(hyperparam_dtype, torch.dtype) or not hyperparam_dtype.is_floating_point
    ):
        raise TypeError(
            f"{_OWNER}: hyperparam_dtype must be None or a floating torch.dtype, got "
            f"{hyperparam_dtype!r}."
        )
    signature = inspect.signature(inner_factory)
    name = getattr(inner_factory, "__name__", "inner_factory")
    unknown = sorted(static - set(signature.parameters))
    if unknown:
        raise ValueError(
            f"{_OWNER}: static_args {unknown} are not parameters of {name}, whose parameters "
            f"are {list(signature.parameters)}."
        )
    return static, signature, name


def _kind_of(name: str, parameter: inspect.Parameter, value: Any, static: set[str],
             hints: dict[str, Any]) -> tuple[str, Any]:
    """``("static" | "numeric" | "schedule", value)``: how one bound argument is passed to
    the factory (static ones as given, or as a Python int for an int parameter)."""
    if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD,
                          parameter.POSITIONAL_ONLY):
        raise TypeError(
            f"{_OWNER}({name}): {name} takes {parameter.name!r} as "
            f"{parameter.kind.description}; inject_hyperparams rebuilds the transform by "
            f"keyword, so it needs a factory whose parameters can all be passed by name."
        )
    if parameter.name in static or isinstance(value, bool):
        return "static", value
    if _declared_int(parameter, hints) and (
        _is_number(value)
        or (isinstance(value, torch.Tensor) and value.dim() == 0
            and not value.is_floating_point())
    ):
        return "static", int(value)
    if isinstance(value, torch.Tensor) or _is_number(value):
        return "numeric", value
    return ("schedule" if callable(value) else "static"), value


def _injected(
    inner_factory: Callable[..., GradientTransformation], name: str,
    hyperparam_dtype: torch.dtype | None, *, other: dict[str, Any], numeric: dict[str, Any],
    schedules: dict[str, Callable[[torch.Tensor], Any]],
) -> GradientTransformation:
    """The transform that rebuilds ``inner_factory(**other, **hyperparams)`` on every update,
    its ``numeric`` hyperparameters and ``schedules``' values held in the state."""
    owner = f"{_OWNER}({name})"
    names = (*sorted(numeric), *sorted(schedules))

    def build(hyperparams: dict[str, Any]) -> GradientTransformation:
        return inner_factory(**other, **hyperparams)

    # Build once with the plain values, so that the factory's checks (which skip
    # tensors) see the Python numbers and fail now, naming the bad value.
    zero = torch.zeros((), dtype=torch.int32)
    build({**numeric, **{k: _first_value(name, k, f, zero) for k, f in schedules.items()}})

    def as_tensor(key: str, value: Any, device: torch.device) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            if hyperparam_dtype is not None and value.is_floating_point():
                return value.to(hyperparam_dtype)
            return value
        if not _is_number(value):
            raise TypeError(
                f"{owner}: state.hyperparams[{key!r}] must be a number or a "
                f"tensor, got {type(value).__name__} {value!r}."
            )
        return torch.tensor(value, dtype=hyperparam_dtype or torch.float64, device=device)

    def values_at(count: torch.Tensor, constants: dict[str, Any]) -> dict[str, torch.Tensor]:
        device = count.device
        hyperparams = {k: as_tensor(k, v, device) for k, v in constants.items()}
        for k, f in schedules.items():
            hyperparams[k] = as_tensor(k, _common.schedule_value(owner, repr(k), f, count),
                                       device)
        return hyperparams

    def init_fn(params: Params) -> InjectHyperparamsState:
        leaves, _ = _core.flatten(params)
        count = _common.zero_count(leaves)
        hyperparams = values_at(count, numeric)
        return InjectHyperparamsState(count, hyperparams, build(hyperparams).init(params))

    def update_fn(
        updates: Updates,
        state: InjectHyperparamsState,
        params: Params | None = None,
        **extra_args: Any,
    ) -> tuple[Updates, InjectHyperparamsState]:
        if not isinstance(state, InjectHyperparamsState):
            raise TypeError(
                f"{owner}: expected an InjectHyperparamsState, got {type(state).__name__}. "
                f"Fix: pass the state returned by this transform's init/update."
            )
        if sorted(state.hyperparams) != sorted(names):
            raise ValueError(
                f"{owner}: state.hyperparams has keys {sorted(state.hyperparams)}, expected "
                f"{sorted(names)}. Fix: edit the values of the existing keys only."
            )
        hyperparams = values_at(state.count, {k: state.hyperparams[k] for k in numeric})
        inner = with_extra_args_support(build(hyperparams))
        updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
        count = _common.safe_increment(state.count)
        return updates, InjectHyperparamsState(count, hyperparams, inner_state)

    def initial(device: torch.device) -> dict[str, torch.Tensor]:
        return values_at(torch.zeros((), dtype=torch.int32, device=device), numeric)

    return specified(GradientTransformation(init_fn, update_fn), Injected(
        build, names, dict(schedules), values_at, initial))
