"""What every ``functopt.optim`` class shares: torch.optim's checks and the fixed options.

A ``functopt.optim`` class is a [`functopt.Optimizer`][functopt.Optimizer] over a chain
built from torch's keyword arguments. The numeric hyperparameters are injected
(``inject_hyperparams``), so they live in ``param_groups`` under torch's names and
schedulers move them. The options that choose the chain's stages (``amsgrad``,
``maximize``, ``nesterov``, ...) are stored in every param group, as torch stores them; a
group that sets its own gets its own chain, built by the class's constructor from the
constructor's arguments with the group's options in their place. A group's options are
read until its first step: its state belongs to its chain, so a later change raises
instead of being silently ignored.
"""

from __future__ import annotations

import inspect
import itertools
import math
import operator
from collections.abc import Callable, Iterable
from typing import Any

import torch

from functopt import _validate
from functopt._base import GradientTransformation
from functopt.adapters import _torch_state, _torch_view
from functopt.adapters.optimizer import COMPILE_NOT_FUSED, Optimizer
from functopt.transforms.hyperparams import inject_hyperparams
from functopt.tree import _ops

__all__: list[str] = []

COMPILE_DIFFERENTIABLE = (
    "{owner}: compile=True with differentiable=True: the compiled tier writes params and "
    "state in place outside autograd, and a differentiable step runs the pure update in the "
    "graph. Fix: pass compile=False with differentiable=True, or differentiable=False to "
    "compile the step."
)

# Execution hints of torch.optim: they choose how torch runs the same maths, so any value
# is accepted (and kept in the groups) here.
HINTS = ("foreach", "fused", "capturable")


def number(owner: str, name: str, value: Any) -> float:
    """A hyperparameter as a Python float (a 1-element tensor's value), checked to be one."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"{owner}: Tensor {name} must be 1-element, got a tensor of shape "
                f"{tuple(value.shape)}. Fix: pass a float or a 0-d tensor."
            )
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{owner}: {name} must be a float, got {type(value).__name__} "
                        f"{value!r}.")
    return float(value)


def check_options(owner: str, **options: Any) -> None:
    """Every option that chooses stages True or False; every execution hint also None.

    torch.optim reads these by truthiness, so a string or a tensor there would pick a
    chain silently (or fail inside PyTorch); here it is a ``TypeError`` naming the option.
    """
    _validate.check_flags(owner, **{k: v for k, v in options.items()
                                    if k not in HINTS or v is not None})


def check(owner: str, ok: bool, torch_message: str, expected: str) -> None:
    """Raise torch.optim's ValueError (its message first, so code matching it still does)."""
    if not ok:
        raise ValueError(f"{owner}: {torch_message} (expected {expected}).")


def check_lr(owner: str, lr: Any) -> None:
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError(f"{owner}: Tensor lr must be 1-element, got shape {tuple(lr.shape)}. "
                         f"Fix: pass a float or a 0-d tensor.")
    value = number(owner, "lr", lr)
    check(owner, value >= 0.0, f"Invalid learning rate: {lr}", "lr >= 0")


def check_nonnegative(owner: str, **values: Any) -> None:
    torch_names = {"eps": "epsilon"}
    for name, value in values.items():
        v = number(owner, name, value)
        check(owner, v >= 0.0 and not math.isnan(v),
              f"Invalid {torch_names.get(name, name)} value: {value}", f"{name} >= 0")


def check_betas(owner: str, betas: Any) -> None:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"{owner}: betas must be a pair (beta1, beta2), got {betas!r}.")
    for i, beta in enumerate(betas):
        v = number(owner, f"betas[{i}]", beta)
        check(owner, 0.0 <= v < 1.0, f"Invalid beta parameter at index {i}: {beta}",
              f"0 <= betas[{i}] < 1")


def listed(params: Any) -> Any:
    """``params`` as a list (it is read twice), unless it is a tensor (rejected later)."""
    if isinstance(params, torch.Tensor) or not isinstance(params, Iterable):
        return params
    return list(params)


def groups_set(params: Any, key: str) -> list[Any]:
    """The values group dicts in ``params`` give for ``key``."""
    if isinstance(params, torch.Tensor) or not isinstance(params, list):
        return []
    return [item[key] for item in params if isinstance(item, dict) and key in item]


# Ranges of the numeric group values (torch.optim checks them in its constructors only; a
# group value out of range would give NaN params or a silent ascent).
_RANGES: dict[str, tuple[float, float, bool]] = {  # key: (low, high, high open)
    "lr": (0.0, math.inf, False), "eps": (0.0, math.inf, False),
    "weight_decay": (0.0, math.inf, False), "momentum": (0.0, math.inf, False),
    "alpha": (0.0, 1.0, False), "rho": (0.0, 1.0, False), "lr_decay": (0.0, math.inf, False),
    "momentum_decay": (0.0, math.inf, False),
    "initial_accumulator_value": (0.0, math.inf, False),
    "beta2_decay": (-math.inf, 0.0, False), "d": (1.0, math.inf, False),
}


# The group keys check_group reads.
_CHECKED_KEYS = (*_RANGES, "betas")
_UNSET = object()  # a fixed option the group does not hold


def _immutable(value: Any) -> bool:
    """None, a number, or a tuple of numbers: a group value that is replaced to be changed."""
    if isinstance(value, tuple):
        return all(isinstance(v, (int, float)) for v in value)
    return value is None or isinstance(value, (int, float))


def check_group(owner: str, where: str, group: dict[str, Any]) -> None:
    """Raise naming the group and key whose value is out of the range torch's constructor
    enforces (Python numbers and 0-d tensors; betas each in [0, 1))."""
    for key, (low, high, high_open) in _RANGES.items():
        value = group.get(key)
        if value is None or (isinstance(value, torch.Tensor) and _ops._recording()):
            continue  # (a recorded step cannot read a tensor: the warm-up steps checked it)
        # (Adafactor's eps is a pair, its first item None or a number)
        pair = key == "eps" and isinstance(value, tuple)
        for item in value if pair else (value,):
            if item is None and pair:
                continue
            v = (float(item.detach()) if isinstance(item, torch.Tensor)
                 else float(item) if isinstance(item, (int, float)) else math.nan)
            if not (low <= v <= high) or (high_open and v == high):
                raise ValueError(
                    f"{owner}: {where}[{key!r}] is {value!r}; expected a number in [{low:g}, "
                    f"{high:g}]. Fix: write a valid value (a scheduler writes only 'lr' and "
                    f"'momentum' or 'betas')."
                )
    betas = group.get("betas")
    if betas is not None:
        ok = isinstance(betas, (tuple, list)) and len(betas) == 2 and all(
            isinstance(b, (int, float, torch.Tensor)) and 0.0 <= float(b) < 1.0 for b in betas)
        if not ok:
            raise ValueError(f"{owner}: {where}['betas'] is {betas!r}; expected a pair of "
                             f"numbers in [0, 1). Fix: write e.g. (0.9, 0.999).")


class _Built(Exception):
    """What a constructor run for a group's options only built (`TorchOptimizer._variant`)."""

    def __init__(self, transform: GradientTransformation, fused: bool) -> None:
        super().__init__()
        self.transform, self.fused = transform, fused


class TorchOptimizer(Optimizer):
    """A functopt.Optimizer with torch.optim's options kept in its param groups: a group
    whose options differ from the constructor's runs its own chain."""

    _owner = "functopt.optim"
    _differentiable_key = True  # torch's class has a differentiable option (Muon's has not)

    def __new__(cls, *args: Any, **kwargs: Any) -> TorchOptimizer:
        self = super().__new__(cls)
        # The constructor's arguments but the params, by name (defaults filled in): a
        # group's own options are built into a chain from them (see _variant).
        self.__dict__["_given"] = _arguments(cls, args, kwargs)
        return self

    def __init__(
        self,
        params: Any,
        factory: Callable[..., GradientTransformation],
        hyperparams: dict[str, Any],
        flags: dict[str, Any],
        fixed: dict[str, Any],
        *,
        lowerable: bool,
        fused: bool | None,
        differentiable: bool,
        compile: bool = False,
    ) -> None:
        owner = f"functopt.optim.{type(self).__name__}"
        if differentiable and fused:
            raise RuntimeError(f"`fused` does not support `differentiable` ({owner}: the fused "
                               f"kernels write in place outside autograd. Fix: leave fused "
                               f"unset with differentiable=True.)")
        _validate.check_flags(owner, compile=compile)
        if compile and differentiable:
            raise ValueError(COMPILE_DIFFERENTIABLE.format(owner=owner))
        if compile and fused is False:
            raise ValueError(COMPILE_NOT_FUSED.format(owner=owner))
        if isinstance(params, torch.Tensor):
            raise TypeError(
                f"{owner}: params argument given to the optimizer should be an iterable of "
                f"Tensors or dicts, but got {torch.typename(params)}. Fix: wrap it in a list, "
                f"or pass model.parameters()."
            )
        # A one-element lr of any shape, as torch takes it: its 0-d view is injected (the
        # groups keep the caller's tensor, which a scheduler may fill in place).
        given_lr = hyperparams.get("learning_rate")
        if isinstance(given_lr, torch.Tensor) and given_lr.dim() and given_lr.numel() == 1:
            hyperparams = {**hyperparams, "learning_rate": given_lr.reshape(())}
        # Module-level factory and plain values: enough to rebuild the transform when the
        # optimizer is unpickled (its closures cannot be pickled).
        transform = _built(factory, hyperparams, flags)
        # fused=None: the fused kernel where the planner has one, the pure path (no warning)
        # elsewhere, as torch picks foreach. fused=True where there is no kernel warns.
        kernel = (lowerable and not differentiable) if fused is None else bool(fused)
        # compile=True: the compiled tier, a fast path, for every chain
        kernel = kernel or compile
        if self.__dict__.get("_building"):  # a group's chain only: see _variant
            raise _Built(transform, kernel)
        self._recipe = (factory, dict(hyperparams), dict(flags))
        # The group dicts given, without their params: a group's own chain is built as
        # this one was, from the same group values.
        self._skeleton = [{k: v for k, v in item.items() if k != "params"}
                          for item in (params if isinstance(params, list) else [])
                          if isinstance(item, dict)]
        # (kept in the groups of the classes whose torch signature has it)
        self._fixed = ({**fixed, "differentiable": differentiable} if self._differentiable_key
                       else fixed)
        # A tensor lr stays the caller's tensor in the groups, as torch.optim keeps it: a
        # scheduler fills it in place, and a recorded step (a CUDA graph) reads it there.
        if isinstance(given_lr, torch.Tensor) and (
                differentiable or not given_lr.requires_grad):
            self._given_defaults = {"lr": given_lr}
        self._differentiable_default = differentiable
        super().__init__(params, transform, fused=kernel, compile=compile)
        self.defaults.update(self._fixed)

    @property
    def transform(self) -> GradientTransformation:
        """The functopt transform this optimizer runs (``inject_hyperparams`` of a chain)."""
        return self._transform

    def _step_owner(self) -> str:
        return f"functopt.optim.{type(self).__name__}"

    def _differentiable(self, index: int, group: dict[str, Any]) -> bool:
        if not group.get("differentiable"):
            return False
        if group.get("foreach"):
            raise AssertionError(
                f"_foreach ops don't support autograd ({self._step_owner()}: param_groups"
                f"[{index}] has foreach=True and differentiable=True. Fix: leave foreach "
                f"unset.)")
        return True

    # How the torch class words its refusal of capturable=True on the CPU: what must be on
    # a supported device, and whether its list of those names XLA.
    _capturable_words: tuple[str, bool] = ("params and state_steps", True)

    # torch's refusal of fused=True for a complex param after the first param with a
    # gradient (its RuntimeError's message), for the classes that check only the first
    # one's device and dtype (SGD, Adagrad); None: every param's.
    _fused_words: str | None = None

    # torch's refusal of a sparse gradient at the step (its RuntimeError's message), for the
    # classes whose torch twin refuses them; None: the class steps them (SGD, Adagrad).
    _sparse_words: str | None = None

    def _dense_grad(self, group: dict[str, Any], j: int, grad: torch.Tensor) -> torch.Tensor:
        if grad.layout is not torch.sparse_coo:
            return super()._dense_grad(group, j, grad)
        where = f"({self._step_owner()}: {self._describe(group, j)} has a sparse gradient."
        if self._sparse_words is not None:
            raise RuntimeError(f"{self._sparse_words} {where} Fix: use a dense embedding "
                               f"(sparse=False), or call grad.to_dense() before the step.)")
        refusal = self._sparse_refusal(group)
        if refusal is not None:
            raise RuntimeError(f"{refusal[0]} {where} Fix: {refusal[1]})")
        # torch steps the entries the gradient holds; a dense gradient that is 0 elsewhere
        # leaves the others as they are (duplicate indices summed, as torch coalesces them).
        # Which params have had a sparse gradient, and its sparse dims: torch's state for
        # them is sparse where it sums gradients (SGD's momentum buffer), and the state dict
        # gives it so (torch's sparse step adds a dense buffer to a sparse gradient nowhere).
        seen: dict[int, int] = self.__dict__.setdefault("_sparse_seen", {})
        seen[id(group["params"][j])] = grad.sparse_dim()
        return grad.coalesce().to_dense()

    # torch's refusal of a complex param at the step (its RuntimeError's message), for the
    # classes whose torch twin refuses them (Adafactor, Muon); None: stepped as real pairs.
    _complex_words: str | None = None

    def _check_complex(self, group: dict[str, Any], grads: list[Any]) -> None:
        if self._complex_words is None:
            return
        for j, (p, g) in enumerate(zip(group["params"], grads, strict=True)):
            if g is not None and p.is_complex():
                raise RuntimeError(
                    f"{self._complex_words} ({self._step_owner()}: {self._describe(group, j)} "
                    f"is {str(p.dtype).removeprefix('torch.')}. Fix: optimize its real pairs "
                    f"(torch.view_as_real) or use another optimizer for it.)")

    def _sparse_refusal(self, group: dict[str, Any]) -> tuple[str, str] | None:
        """torch's message and the fix, where the class refuses a sparse gradient for the
        group's options (SGD's and Adagrad's fused kernels, Adagrad's weight decay)."""
        return None

    # Which leaf of the chain's state each of torch's per-param keys is (each class's own).
    _torch_layout: _torch_state.TorchLayout

    def _shown_state(self, store: Any) -> _torch_view.StateView:
        # optimizer.state in torch's layout, over the entries the steps read and write
        view: _torch_view.StateView | None = self.__dict__.get("_view")
        if view is None:
            view = self.__dict__["_view"] = _torch_view.StateView(self, self._torch_layout)
        return view

    def _set_shown_state(self, value: Any) -> None:
        view = self._shown_state(None)
        if value is not view:
            view.replace(value)

    @torch._disable_dynamo  # type: ignore[attr-defined]
    def _flush_view(self) -> None:
        """Take the shown ``step``s written in place into the state (see _torch_view)."""
        view: _torch_view.StateView | None = self.__dict__.get("_view")
        if view is not None:
            view.flush()

    @torch._disable_dynamo  # type: ignore[attr-defined]
    def state_dict(self) -> dict[str, Any]:
        """torch.optim's state dict of this class: each param that has stepped has an entry
        with torch's keys (``step`` as torch stores it), each group torch's keys; it loads
        into the torch.optim class of the same name, which then continues the run. The
        state tensors are the live ones, not copies (the next step then writes new ones)."""
        self._flush_view()
        self._state_shared = True
        return _torch_state.state_dict(self, self._torch_layout)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``torch.optim.Optimizer.load_state_dict``: torch's layout (this class's
        ``state_dict()``, or the torch.optim class's), or functopt's own format."""
        view: _torch_view.StateView | None = self.__dict__.get("_view")
        if view is not None:
            view.forget()
        super().load_state_dict(state_dict)

    def _loaded_entries(self, owner: str, group: dict[str, Any], plan: Any, config: Any,
                        entries: list[Any], hyper: dict[str, Any]) -> list[Any]:
        # torch's layout (this class's state_dict(), or torch.optim's), or functopt's own
        return _torch_state.loaded_entries(self, self._torch_layout, owner, group, plan,
                                           config, entries, hyper)

    def _kept_keys(self) -> frozenset[str]:
        # torch's fixed options and execution hints: checked here, kept in every group.
        return frozenset({*self.__dict__.get("_fixed", {}), *HINTS})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """``torch.optim.Optimizer.add_param_group``; a group with options of its own (the
        ones that choose the chain's stages) gets its own chain."""
        owner = f"functopt.optim.{type(self).__name__}.add_param_group"
        if not isinstance(param_group, dict):
            raise TypeError(f"{owner}: expected a dict such as {{'params': [...], 'lr': 0.1}}, "
                            f"got {type(param_group).__name__}.")
        group = dict(param_group)
        for key, value in self.__dict__.get("_fixed", {}).items():
            group.setdefault(key, value)  # (before the group's chain is chosen)
        super().add_param_group(group)
        try:
            check_group(owner, f"param group {len(self.param_groups) - 1}",
                        self.param_groups[-1])
            if self.__dict__.get("_compile") and self.param_groups[-1].get("differentiable"):
                raise ValueError(COMPILE_DIFFERENTIABLE.format(
                    owner=f"{owner}: param group {len(self.param_groups) - 1}"))
        except ValueError:
            self.param_groups.pop()
            raise

    def _group_transform(self, index: int, group: dict[str, Any]) -> GradientTransformation:
        """The chain of the group's options: the constructor's, or one built for them."""
        fixed = self._fixed
        keys = self.__dict__.get("_option_keys")
        if keys is None:
            keys = self._option_keys = tuple(k for k in fixed
                                             if k not in HINTS and k != "differentiable")
        values = [group.get(k, fixed[k]) for k in keys]
        # (the groups hold the very objects they were given: identity is the fast check)
        resolved: list[tuple[list[Any], GradientTransformation]] = self.__dict__.setdefault(
            "_resolved", [])
        for seen, transform in resolved:
            if all(map(operator.is_, seen, values)):
                return transform
        options = {k: v for k, v in zip(keys, values, strict=True) if not _same(v, fixed[k])}
        transform = self._variant(index, options) if options else self._transform
        if len(resolved) >= 16:
            del resolved[0]
        resolved.append((values, transform))
        return transform

    def _variant(self, index: int, options: dict[str, Any]) -> GradientTransformation:
        """The chain the class's constructor builds from its arguments with ``options``
        (a group's) in their place: the constructor's own checks and choice of stages."""
        variants: dict[str, tuple[GradientTransformation, bool, dict[str, Any]]] = (
            self.__dict__.setdefault("_variants", {}))
        key = repr(sorted(options.items()))
        if key in variants:
            return variants[key][0]
        owner = f"functopt.optim.{type(self).__name__}"
        given = self.__dict__.get("_given")
        # the class's constructor, or the nearest one that takes every option (AdamW's
        # decoupled_weight_decay is an argument of Adam's)
        init = next((c.__init__ for c in type(self).__mro__
                     if issubclass(c, TorchOptimizer) and c is not TorchOptimizer
                     and set(options) <= set(inspect.signature(c.__init__).parameters)),
                    None)
        if given is None or init is None:
            raise ValueError(
                f"{owner}: param_groups[{index}] sets {options}, which functopt cannot build "
                f"a chain for (no constructor of this class takes them all). Fix: build a "
                f"separate optimizer for these params.")
        names = inspect.signature(init).parameters
        kwargs = {k: v for k, v in {**given, **options}.items() if k in names}
        probe = type(self).__new__(type(self))
        probe.__dict__["_building"] = True
        try:
            init(probe, [dict(g) for g in self.__dict__.get("_skeleton", [])], **kwargs)
        except _Built as built:
            variants[key] = (built.transform, built.fused, options)
            return built.transform
        except (ValueError, TypeError) as error:
            raise type(error)(f"{owner}: param_groups[{index}] holds {options}, which the "
                              f"constructor rejects: {error}") from None
        raise AssertionError(f"{owner}'s constructor built no chain")  # pragma: no cover

    def _group_fused(self, transform: GradientTransformation) -> bool:
        for made, fused, _ in self.__dict__.get("_variants", {}).values():
            if made is transform:
                return bool(fused)
        return self._fused

    def _changed_transform(self, index: int, group: dict[str, Any], plan: Any) -> Exception:
        before: dict[str, Any] = dict(self._fixed)
        for made, _, options in self.__dict__.get("_variants", {}).values():
            if made is plan.transform:
                before.update(options)
        changed = ", ".join(f"{k}={before[k]!r} -> {group.get(k, self._fixed[k])!r}"
                            for k in self._option_keys
                            if not _same(group.get(k, self._fixed[k]), before[k]))
        return ValueError(
            f"functopt.optim.{type(self).__name__}.step: param_groups[{index}] changed "
            f"{changed} after its first step. These options choose the group's chain, and "
            f"its state is that chain's. Fix: set them when the group is added (in the "
            f"constructor or add_param_group), or build a separate optimizer for these "
            f"params.")

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """``torch.optim.Optimizer.step``: update every param group (after ``closure``)."""
        if self.__dict__.get("_view") is not None:
            self._flush_view()
        watched = _CHECKED_KEYS
        # Per group, the values last checked: a group that holds the very same objects
        # again (numbers, tuples, None) is not checked again; a tensor value always is.
        checked: dict[int, list[Any]] = self.__dict__.setdefault("_checked", {})
        # The groups with fused=True whose params were checked for the fused kernels, as
        # torch.optim checks them once.
        fused_checked: set[int] = self.__dict__.setdefault("_fused_checked", set())
        for i, group in enumerate(self.param_groups):
            get = group.get
            if get("capturable") and not torch.compiler.is_compiling():
                _check_capturable(f"functopt.optim.{type(self).__name__}.step", i, group,
                                  *self._capturable_words)
            if get("fused") and i not in fused_checked and not torch.compiler.is_compiling():
                if _check_fused(f"functopt.optim.{type(self).__name__}.step", i, group,
                                self._fused_words):
                    fused_checked.add(i)
            values = list(map(get, watched, itertools.repeat(_UNSET)))
            last = checked.get(i)
            if last is not None and all(map(operator.is_, last, values)):
                continue
            checked.pop(i, None)
            check_group(f"functopt.optim.{type(self).__name__}.step", f"param_groups[{i}]",
                        group)
            if all(v is _UNSET or _immutable(v) for v in values):
                checked[i] = values
        view = self.__dict__.get("_view")
        donated = not self._state_shared
        if "fused" in self._fixed and (self.__dict__.get("grad_scale") is not None
                                       or self.__dict__.get("found_inf") is not None):
            loss = self._scaled_step(closure)
        else:
            loss = self._step(closure)  # (not super().step: torch hooks that one too)
        if view is not None:
            self._kept_in_place(donated)
        return loss

    @torch._disable_dynamo  # type: ignore[attr-defined]
    def _kept_in_place(self, donated: bool) -> None:
        """The tensors read through ``optimizer.state`` keep the step's values (see
        _torch_view)."""
        self.__dict__["_view"].kept_in_place(donated)

    def _scaled_step(self, closure: Callable[[], Any] | None) -> Any:
        """``step`` with ``optimizer.grad_scale`` / ``optimizer.found_inf`` set, as a
        ``GradScaler`` sets them on a fused torch optimizer: a nonzero ``found_inf`` skips
        the step (params, state and step counts as they were), else the gradients are
        divided by ``grad_scale`` in place, as torch's fused kernels unscale them, and the
        step runs. torch's other implementations refuse the attributes: so do non-fused
        groups here."""
        owner = f"functopt.optim.{type(self).__name__}.step"
        for i, group in enumerate(self.param_groups):
            if not group.get("fused"):
                raise AssertionError(
                    f"Expected grad_scale and found_inf to be None ({owner}: param_groups[{i}] "
                    f"is not fused, and only the fused implementation reads "
                    f"optimizer.grad_scale and optimizer.found_inf. Fix: pass fused=True, or "
                    f"delete the attributes and let GradScaler unscale the gradients.)")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = self.__dict__.get("found_inf")
        if found_inf is not None and bool(found_inf):
            return loss
        grad_scale = self.__dict__.get("grad_scale")
        if grad_scale is not None:
            grads: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        grads.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
            with torch.no_grad():
                for (device, _), tensors in grads.items():
                    torch._foreach_div_(tensors, grad_scale.to(device).reshape(()))
        self._step(None)
        return loss

    def __getstate__(self) -> dict[str, Any]:
        self._flush_view()
        return {**super().__getstate__(), "_fixed": self._fixed, "_recipe": self._recipe,
                "_given": self.__dict__.get("_given"),
                "_skeleton": self.__dict__.get("_skeleton", [])}

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Pickle without the transform's closures; __setstate__ rebuilds it from the recipe.
        state = self.__getstate__()
        state.pop("_transform", None)
        return (_rebuild, (type(self),), state)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if "_transform" not in self.__dict__:
            self._transform = _built(*self._recipe)


def _check_capturable(owner: str, index: int, group: dict[str, Any], what: str,
                      xla: bool) -> None:
    """torch.optim's refusal of ``capturable=True`` for a param with a gradient on a device a
    CUDA graph cannot record (the CPU): its AssertionError and message (``what`` the class's
    words, ``xla`` whether its list names XLA), at the step."""
    from torch.optim.optimizer import _get_capturable_supported_devices
    supported = list(_get_capturable_supported_devices(supports_xla=xla))
    for j, p in enumerate(group["params"]):
        if p.grad is not None and p.device.type not in supported:
            raise AssertionError(
                f"If capturable=True, {what} must be on supported devices: "
                f"{supported}. ({owner}: param {j} of param_groups[{index}] is on "
                f"{p.device}. Fix: pass capturable=False, the default, for params there.)"
            )


def _check_fused(owner: str, index: int, group: dict[str, Any], later: str | None) -> bool:
    """torch.optim's refusal of ``fused=True`` for a param with a gradient that is not a
    floating-point tensor on a device with fused kernels (a complex param): its
    RuntimeError and message, at the step; with ``later`` (the class's words for the params
    after the first, which torch checks for complex only), the first param with a gradient
    gets that message. Whether a param with a gradient was checked."""
    from torch.optim.optimizer import (  # type: ignore[attr-defined]
        _get_fused_kernels_supported_devices,
    )
    supported = _get_fused_kernels_supported_devices()
    checked = False
    for j, p in enumerate(group["params"]):
        if p.grad is None:
            continue
        if checked and later is not None:
            refused, words = p.is_complex(), later
        else:
            refused = not (p.device.type in supported and torch.is_floating_point(p))
            words = (f"`fused=True` requires all the params to be floating point Tensors of "
                     f"supported devices: {supported} but {p.dtype} and {p.device.type}")
        checked = True
        if refused:
            raise RuntimeError(
                f"{words} ({owner}: param {j} of param_groups[{index}] is "
                f"{str(p.dtype).removeprefix('torch.')} on {p.device.type}. Fix: leave fused "
                f"unset for these params; functopt steps complex params as their real pairs "
                f"without it.)")
    return checked


def _built(factory: Callable[..., GradientTransformation], hyperparams: dict[str, Any],
           flags: dict[str, Any]) -> GradientTransformation:
    """The chain with ``hyperparams`` injected and ``flags`` (the options that choose its
    stages, a number such as SGD's ``dampening`` too) fixed: a flag is no group value."""
    return inject_hyperparams(factory, static_args=tuple(flags))(**hyperparams, **flags)


def _arguments(cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """``cls``'s constructor arguments by name, its defaults filled in, but ``self`` and
    the params (None where they do not bind: the constructor raises then)."""
    if not args and not kwargs:
        return None
    signature = inspect.signature(cls.__init__)  # type: ignore[misc]
    try:
        bound = signature.bind(None, *args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    skip = list(signature.parameters)[:2]
    return {k: v for k, v in bound.arguments.items() if k not in skip}


def _rebuild(cls: type[TorchOptimizer]) -> TorchOptimizer:
    return cls.__new__(cls)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return bool(torch.as_tensor(a) == torch.as_tensor(b))
    return bool(a == b)
