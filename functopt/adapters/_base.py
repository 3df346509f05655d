"""The surface functopt's two ``torch.optim.Optimizer`` adapters share.

[`functopt.Optimizer`][functopt.Optimizer] keeps a transform's state as entries of
``optimizer.state``; [`MixedPrecisionOptimizer`][functopt.MixedPrecisionOptimizer] keeps
one mixed-precision step's state and shows it as such entries. What code written for
``torch.optim`` sees of either is one surface, held here once: ``optimizer.state``, the
state-dict calls (saved and sealed, checked and loaded, by id or by name), schedule-free
``eval()`` / ``train()``, the group-add check and what a copy keeps. Each adapter says,
through a few hooks, how its own state is read, written and loaded.
"""

from __future__ import annotations

import contextlib
import gc
import pickle
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, ClassVar

import torch

from functopt._base import GradientTransformation
from functopt._spec import Injected, describe
from functopt.adapters import _param_groups, _state_dict
from functopt.optimizers import recipe_of
from functopt.transforms.hyperparams import inject_hyperparams

__all__ = ["AdapterBase"]

SCHEDULE_FREE_STAGES = (
    "{owner}.eval: param_groups[{index}]'s transform has {count} schedule_free stages; "
    "train()/eval() switch the params of schedule-free optimizers "
    "(functopt.contrib.schedule_free_adamw, schedule_free_sgd, schedule_free(...)), each "
    "group's by its own stage. Fix: evaluate without eval(), or give every group that is not "
    "frozen one schedule_free stage."
)


class AdapterBase(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` over a functopt state: the calls both adapters answer
    alike. A subclass names itself in ``_owner`` (the start of its error messages) and
    implements the hooks below (``_read_state``, ``_unsealed_state_dict``, ``_load``,
    ``_schedule_free_state``, ``_evaluation_point``, ``_add_group``, ``_copied``)."""

    _owner: ClassVar[str]
    # the training params kept by eval() (schedule-free), each with its value, restored by
    # train(); None in train mode
    _train_params: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    # state_dict() or load_state_dict() handed the live tensors over: the next step writes
    # new ones instead of updating these in place
    _state_shared: bool

    # -- optimizer.state ------------------------------------------------------------------

    @property
    def state(self) -> Any:
        """``torch.optim.Optimizer.state``: per param, its entry of the state (state paths
        to its tensors, the live state; a ``functopt.optim`` class shows torch's keys), as
        ``torch.optim`` keeps it, so ``torch.distributed.checkpoint``'s state-dict helpers
        find the state and take no initialising step. A frozen param's entry is empty.

        ``functopt.Optimizer`` makes a group's entries when this is first read (or at the
        group's first step), and they may be changed or cleared as torch.optim's.
        ``MixedPrecisionOptimizer`` shows a view of its step's state, rebuilt at each read:
        a tensor written into an entry over one of the same shape is copied into the live
        state, a key that is no tensor (what a state-dict hook stores) is kept, saved and
        loaded, and any other write under a param raises (it would be lost)."""
        return self._read_state()

    @state.setter
    def state(self, value: Any) -> None:
        self._write_state(value)

    def _read_state(self) -> Any:
        """What ``optimizer.state`` reads."""
        raise NotImplementedError

    def _write_state(self, value: Any) -> None:
        """``optimizer.state = value`` (torch.optim's constructor sets it first)."""
        raise NotImplementedError

    # -- state dicts ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.Optimizer.state_dict``: ``{"state": {id: entry}, "param_groups":
        [...]}``, each entry mapping state paths to the param's tensors and each group
        holding its keys, its params' ids and names, and under ``"functopt"`` the
        configuration its state needs (format, recipe; a ``MixedPrecisionOptimizer``'s
        loss-scale rule and master dtype too), which ``load_state_dict`` checks. The
        state-dict hooks run as in ``torch.optim``. It loads with
        ``torch.load(weights_only=True)`` and through ``torch.distributed.checkpoint``.

        The tensors are the live state, not copies: the next step then writes new state
        tensors instead of updating these in place, so a state dict taken before a step
        keeps its values (later steps update in place again). With DTensor state (FSDP2)
        the first group's record also holds the dict's integrity record, which
        ``load_state_dict`` checks, so a torn distributed checkpoint raises on every rank:
        both calls are then collectives over the default group (docs/sharded-state.md).
        """
        saved = self._unsealed_state_dict()
        _state_dict.seal(saved)
        return saved

    def _unsealed_state_dict(self) -> dict[str, Any]:
        """``state_dict()`` before its integrity record (hooks run, ``_state_shared`` set)."""
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved by ``state_dict()`` (or ``named_state_dict()`` through
        ``load_named_state_dict``).

        Entries are matched to params by name where the saved groups and these name their
        params (``model.named_parameters()``), whatever the order; names that differ raise,
        naming them. Each entry must hold the keys the state has for that param, with its
        shapes; tensors are moved to the dtypes and devices the state holds them in. A
        checkpoint saved under another recipe (a ``MixedPrecisionOptimizer``'s: another
        loss-scale rule or master dtype) raises, naming it. A ``functopt.Optimizer`` group
        whose params have no entry at all restarts from ``transform.init``. The sealed record of a
        distributed checkpoint is checked before the load hooks run; the hooks run as in
        ``torch.optim``. Raises in ``eval()`` mode (call ``train()`` first).
        """
        owner = f"{self._owner}.load_state_dict"
        self._check_ready("load_state_dict")
        self._check_train_mode("load_state_dict")
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"{owner}: expected a state dict (a dict with keys 'state' and 'param_groups', "
                f"as optimizer.state_dict() returns), got {type(state_dict).__name__}.")
        state_dict = dict(state_dict)
        if "state" in state_dict:
            _state_dict.check_seal(owner, state_dict)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._load(owner, state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _load(self, owner: str, state_dict: dict[str, Any]) -> None:
        """``load_state_dict``'s body, between the load hooks."""
        raise NotImplementedError

    def named_state_dict(self) -> dict[str, Any]:
        """The state dict keyed by parameter names: ``state`` maps each param's name to its
        entry, each group lists its params' names. It is the layout
        ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` gives (which DCP
        saves and reshards); ``state_dict()``'s int ids are the view of it that
        ``torch.optim`` code expects. Needs named params (``model.named_parameters()``).

        Examples:
            >>> import torch, functopt
            >>> model = torch.nn.Linear(2, 1)
            >>> opt = functopt.Optimizer(model.named_parameters(), functopt.adamw(0.1))
            >>> sorted(opt.named_state_dict()["state"])
            ['bias', 'weight']
            >>> opt.load_named_state_dict(opt.named_state_dict())
        """
        return _state_dict.torch_to_named(f"{self._owner}.named_state_dict", self.state_dict())

    def load_named_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict keyed by parameter names (``named_state_dict()``, or
        ``get_optimizer_state_dict``'s): each param gets the entry saved under its name, in
        whatever order the groups list them; names that differ raise, naming them."""
        self.load_state_dict(_state_dict.named_to_torch(
            f"{self._owner}.load_named_state_dict", state_dict))

    # -- schedule-free: train / eval ------------------------------------------------------

    def eval(self) -> None:
        """Move the params to the schedule-free evaluation point, as the schedulefree
        package's optimizers do: ``x = (y - (1 - b1) z) / b1``
        ([`schedule_free_eval_params`][functopt.contrib.schedule_free_eval_params]), the
        averaged iterate where the model is evaluated, from each group's own
        ``schedule_free`` stage; ``y`` is the training iterate (a
        ``MixedPrecisionOptimizer``'s master weights, ``x`` rounded to the params' dtype).
        The training params are kept, so ``train()`` restores them bitwise and training
        continues exactly as if ``eval()`` had not been called; the optimizer's state is not
        touched. Until ``train()``, ``step()`` and ``load_state_dict`` raise (a
        ``MixedPrecisionOptimizer``'s ``reload_model_params`` too). A no-op when already in
        eval mode.

        A checkpoint of the optimizer taken in eval mode resumes training as one taken in
        train mode; the params of a model saved in eval mode are ``x``, not the training
        iterate.

        Raises:
            TypeError: a param group that is not frozen has no ``schedule_free`` stage, or
                several; nothing is moved then.
        """
        if self._train_params is not None:
            return
        self._check_ready("eval")
        from functopt.contrib import ScheduleFreeState

        points: list[tuple[torch.Tensor, torch.Tensor]] = []
        with torch.no_grad():
            for index, group in enumerate(self.param_groups):
                state = self._schedule_free_state(index, group)
                if state is None:  # a frozen group: nothing to move
                    continue
                found = find_states(state, ScheduleFreeState)
                if len(found) != 1:
                    raise TypeError(SCHEDULE_FREE_STAGES.format(
                        owner=self._owner, index=index, count=len(found)))
                points.extend(self._evaluation_point(index, group, found[0]))
            kept = []
            for p, value in points:
                kept.append((p, p.detach().clone()))
                p.copy_(value)
        self._train_params = kept

    def train(self) -> None:
        """Back to the training params after ``eval()`` (bitwise the ones ``eval()`` left);
        a no-op in train mode."""
        kept = self._train_params
        if kept is None:
            return
        with torch.no_grad():
            for p, value in kept:
                p.copy_(value)
        self._train_params = None

    def _check_train_mode(self, method: str) -> None:
        if self._train_params is not None:
            raise RuntimeError(
                f"{self._owner}.{method}: the params hold the schedule-free evaluation point "
                f"(after optimizer.eval()). Fix: call optimizer.train() before {method}().")

    def _check_ready(self, method: str) -> None:
        """Raise where ``method`` cannot run in the optimizer's present state."""

    def _schedule_free_state(self, index: int, group: dict[str, Any]) -> Any:
        """The state of the group's transform, where ``eval()`` looks for its
        ``schedule_free`` stage; None for a frozen group."""
        raise NotImplementedError

    def _evaluation_point(self, index: int, group: dict[str, Any],
                          stage: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each param of the group with its value at the evaluation point of ``stage``
        (the group's ``ScheduleFreeState``)."""
        raise NotImplementedError

    # -- param groups ---------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (``torch.optim``'s call). ``functopt.Optimizer`` gives it its own
        freshly initialised transform state, keys the group does not set taking the values
        the transform was built with. ``MixedPrecisionOptimizer`` refuses it after
        construction: its groups' master copies, state and partition are made then."""
        if not isinstance(param_group, dict):
            raise TypeError(
                f"{self._owner}.add_param_group: expected a dict such as "
                f"{{'params': [...], 'lr': 0.1}}, got {type(param_group).__name__}."
            )
        self._add_group(dict(param_group))

    def _add_group(self, group: dict[str, Any]) -> None:
        """``add_param_group``'s body, for a dict (a copy of the one given)."""
        raise NotImplementedError

    # -- copies ---------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        # A copy (copy.deepcopy, pickle) holds what the adapter says it needs, and the eval
        # mode: a copy made in eval mode gets its training params back from train().
        return {**self._copied(), "_train_params": self._train_params}

    def _copied(self) -> dict[str, Any]:
        """What a copy of the optimizer holds (``__getstate__``)."""
        raise NotImplementedError


def check_frozen_entries(owner: str, index: int, entries: list[Any]) -> None:
    """Raise where a state dict holds state for the params of frozen group ``index``."""
    if any(entries):
        raise ValueError(
            f"{owner}: param_groups[{index}] is frozen, but the state dict holds optimizer "
            f"state for its params; a frozen group has none. Fix: load a state dict saved "
            f"with the same groups frozen.")


def find_states(tree: Any, cls: type) -> list[Any]:
    """Every ``cls`` instance in a state tree (NamedTuples, tuples, lists, dicts)."""
    if isinstance(tree, cls):
        return [tree]
    if isinstance(tree, dict):
        children: Iterable[Any] = tree.values()
    elif isinstance(tree, (tuple, list)):
        children = tree
    else:
        return []
    return [found for child in children for found in find_states(child, cls)]


def immutable(value: Any) -> bool:
    """Whether a group value cannot change without being replaced: a number, a string,
    None, a tuple of those, or a callable (a schedule or a factory argument, which the
    groups compare by identity). Not a tensor: one may be filled in place."""
    if isinstance(value, tuple):
        return all(immutable(v) for v in value)
    return value is None or isinstance(value, (int, float, str)) or (
        callable(value) and not isinstance(value, torch.Tensor))


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def lift(tx: GradientTransformation) -> GradientTransformation:
    """A plain recipe as ``inject_hyperparams`` of itself, its ``RECIPE_GROUP_KEYS``
    arguments given as numbers injected and every other argument fixed; any other transform
    as it is (one built by ``inject_hyperparams`` already injects what it exposes)."""
    if isinstance(describe(tx), Injected):
        return tx
    record = recipe_of(tx)
    if record is None or record.name not in _param_groups.RECIPE_GROUP_KEYS:
        return tx
    listed = [a for args in _param_groups.RECIPE_GROUP_KEYS[record.name].values() for a in args]
    injected = [a for a in listed if is_number(record.arguments.get(a)) or (
        isinstance(record.arguments.get(a), torch.Tensor) and record.arguments[a].dim() == 0)]
    if not injected:
        return tx
    static = [a for a in record.arguments if a not in injected]
    return inject_hyperparams(record.factory, static_args=static)(**record.arguments)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block (if it was on): the objects made
    there are freed by reference counting all the same."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


OPTIMIZER_NOT_PICKLABLE = (
    "functopt.Optimizer cannot be pickled: its transform is made of functions local to the "
    "transform's factory (a chain or a transform of your own returns closures), and pickle "
    "stores functions by their importable name ({error}); a recipe's optimizer pickles as "
    "the recipe's call, when its arguments pickle (not a lambda schedule). Fix: save "
    "opt.state_dict() with torch.save, and to resume build the optimizer again with the same "
    "transform and call load_state_dict (the usual checkpoint); copy.deepcopy(opt) makes an "
    "in-process copy."
)

_PICKLING_ERRORS = (pickle.PicklingError, AttributeError, TypeError)


class HeldTransform:
    """The transform inside a copied or pickled Optimizer's state: deep copies share it (a
    transform is immutable: two functions and a spec). A pickle stores the transform as it
    is if it pickles, else the recipe's call that built it (``source``: the recipe is a
    module-level function, its arguments plain values), which unpickling makes again; a
    transform that is neither raises, saying why."""

    __slots__ = ("source", "transform")

    def __init__(self, transform: GradientTransformation, source: Any = None) -> None:
        self.transform = transform
        self.source = source

    def __deepcopy__(self, memo: dict[int, Any]) -> HeldTransform:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        try:
            pickle.dumps(self.transform)
        except _PICKLING_ERRORS as error:
            if self.source is not None:
                call = (self.source.factory, self.source._args, self.source._kwargs)
                try:
                    pickle.dumps(call)
                except _PICKLING_ERRORS:
                    pass
                else:
                    return (_remade, call)
            raise TypeError(OPTIMIZER_NOT_PICKLABLE.format(error=error)) from None
        return (HeldTransform, (self.transform,))


def _remade(factory: Callable[..., GradientTransformation], args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> HeldTransform:
    """The held transform of an unpickled Optimizer: its recipe's call made again, lifted as
    the constructor lifts it."""
    given = factory(*args, **kwargs)
    return HeldTransform(lift(given), recipe_of(given))
