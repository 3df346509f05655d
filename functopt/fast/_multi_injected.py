"""A `_multi.Split` inside ``inject_hyperparams``: ``inject_hyperparams(lambda learning_rate:
chain(clip_by_global_norm(1.0), MultiSteps(adamw(learning_rate), k)...))(...)``.

The planner lowers a ``MultiSteps`` inside an injection where it is the first rule of its
leaves (``functopt/fast/_inside.py``); with elements before it in the chain (a clip that
measures each mini-step's gradients) it is the chain's `Split` instead, built from this
step's hyperparameters as the pure ``inject_hyperparams`` builds its inner transform:

- every step computes the hyperparameters with the injection's own ``values_at`` and
  builds the inner transform from them (the pure update does the same), whose `Split` then
  runs as `_multi.multi_step` runs it: the prefix's own updates, ``MultiSteps.window``, the
  ``foreach`` accumulation;
- the closing mini-step is the fast step of an injection of the closing transform
  (`InjectedSplit.closing`: ``chain(inner, suffix...)`` built from the same
  hyperparameters, which the planner binds to the state's values), on the injection's
  count and values;
- the injection's count and values are then written as its update writes them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from functopt._base import GradientTransformation, Params, State, with_extra_args_support
from functopt._spec import Injected, describe, specified
from functopt.fast._errors import warn_lost
from functopt.fast._multi import Split, multi_step
from functopt.transforms import _common
from functopt.transforms.hyperparams import InjectHyperparamsState
from functopt.tree import _core

__all__ = ["InjectedSplit"]


def _constants(spec: Injected) -> tuple[str, ...]:
    return tuple(k for k in spec.names if k not in spec.schedules)


def _split(spec: Injected, hyper: dict[str, Any]) -> Split | None:
    """The split of the inner transform built from ``hyper``, if it has a prefix (without
    one the planner takes it: ``_inside.py``)."""
    split = Split.of(spec.build(hyper))
    return split if split is not None and split.prefix else None


def _closing(spec: Injected) -> GradientTransformation:
    """``inject_hyperparams`` of the closing transform of the inner transform's split: the
    same hyperparameters, count and values; its state an ``InjectHyperparamsState`` whose
    inner state is the closing transform's."""
    def build(hyper: dict[str, Any]) -> GradientTransformation:
        split = Split.of(spec.build(hyper))
        assert split is not None
        return split.closing

    def init(params: Params) -> State:
        del params
        raise TypeError("the closing step of an injected MultiSteps has no init: initialise "
                        "the injection itself")

    def update(updates: Any, state: InjectHyperparamsState, params: Params | None = None,
               **extra_args: Any) -> tuple[Any, InjectHyperparamsState]:
        hyper = spec.values_at(state.count, {k: state.hyperparams[k] for k in _constants(spec)})
        new_updates, inner = with_extra_args_support(build(hyper)).update(
            updates, state.inner_state, params, **extra_args)
        return new_updates, InjectHyperparamsState(_common.safe_increment(state.count), hyper,
                                                   inner)

    return specified(GradientTransformation(init, update), Injected(
        build, spec.names, spec.schedules, spec.values_at))


@dataclass(frozen=True)
class InjectedSplit:
    """An injection whose inner transform is a `Split` with a prefix (see the module
    docstring); ``closing``: the injection of its closing transform, stepped fast."""

    spec: Injected
    closing: GradientTransformation
    whole: GradientTransformation  # the injection (its pure update, for a bad state)

    @classmethod
    def of(cls, tx: GradientTransformation) -> InjectedSplit | None:
        """The injected split of ``tx``, or None. Probed with values 1.0 for the constants
        (a factory that refuses them, or builds another structure from them, is not one)."""
        spec = describe(tx)
        if not isinstance(spec, Injected):
            return None
        try:
            with warnings.catch_warnings():  # (the probe's values are not the user's)
                warnings.simplefilter("ignore")
                probe = spec.values_at(torch.zeros((), dtype=torch.int32), {
                    k: torch.ones((), dtype=torch.float64) for k in _constants(spec)})
                found = _split(spec, probe)
        except Exception:  # (a factory's own check of a value: not a split we know)
            return None
        return None if found is None else cls(spec, _closing(spec), tx)

    def split_of(self, state: Any) -> tuple[Split, dict[str, Any]] | None:
        """This step's split and hyperparameters, or None where ``state`` is not this
        injection's (the pure update then says what is wrong) or the values build another
        structure."""
        if not (isinstance(state, InjectHyperparamsState) and isinstance(state.hyperparams, dict)
                and sorted(state.hyperparams) == sorted(self.spec.names)):
            return None
        hyper = self.spec.values_at(state.count, {k: state.hyperparams[k]
                                                  for k in _constants(self.spec)})
        split = _split(self.spec, hyper)
        if split is None:
            warn_lost("make_step", "the injected transform built from this step's values is "
                      "not a chain with a MultiSteps after per-leaf rules or clips, as the "
                      "one built from 1.0 was", stacklevel=5)
            return None
        if split.multi_state(state.inner_state) is None:
            return None
        return split, hyper

    def step(self, closing_step: Callable[..., tuple[Params, State]],
             apply: Callable[[list[Any], Any, Any, bool], Params], grads: Any, state: Any,
             params: Params, extra_args: dict[str, Any], *, donate: bool,
             ) -> tuple[Params, State]:
        """One step (`_multi.multi_step` of this step's split, the injection around it);
        ``closing_step`` is the fast step of ``closing``."""
        found = self.split_of(state)
        if found is None:
            updates, new_state = self.whole.update(grads, state, params, **extra_args)
            leaves, treespec = _core.flatten(params)
            return apply(leaves, treespec, updates, donate), new_state
        split, hyper = found
        # (now: a donated closing step advances the injection's host count in place)
        count = _common.safe_increment(state.count)

        def injected_closing(inner_grads: Any, closing_state: Any, params: Params,
                             **extra: Any) -> tuple[Params, State]:
            new_params, new = closing_step(
                inner_grads, InjectHyperparamsState(state.count, state.hyperparams,
                                                    closing_state), params, **extra)
            return new_params, new.inner_state

        new_params, inner = multi_step(split, injected_closing, apply, grads, state.inner_state,
                                       params, extra_args, donate=donate)
        return new_params, InjectHyperparamsState(count, hyper, inner)
