"""Params without a gradient on some steps under ``MixedPrecisionOptimizer`` over a torch
optimizer: exact as torch.optim, or an error.

torch.optim counts steps per param (``state[p]["step"]``) and skips a param whose
``.grad`` is None. ``functopt.Optimizer`` and the ``functopt.optim`` classes do the same
(``_torch_state``). ``MixedPrecisionOptimizer`` runs a translated torch.optim optimizer's
rule over all its params at once, with one count: a param without a gradient is left as
it is, state included, but the count still advances when others step. So a param that
missed steps and then steps again sees that count where torch.optim would use its own,
and where the rule reads the count per param, the update differs:

- ``ALL``: the count enters every step (Adam's bias corrections, NAdam's momentum
  schedule, RAdam's rectification, Adagrad with ``lr_decay``): a param whose own count is
  not the optimizer's differs.
- ``FIRST``: only the first step is special (SGD's dampened momentum takes its first
  gradient undamped): a param that steps for the first time after the others have
  stepped differs.
- ``NONE``: the count enters no param's maths (plain or Nesterov momentum, RMSprop,
  Adadelta, Rprop, Adagrad without ``lr_decay``): always exact.

``MissedSteps`` keeps the steps each param missed (only those that missed any), and raises
before a step that would differ; a param that never gets a gradient again is never a
difference. Nothing is done on a step where every param has a gradient and none missed one
before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

__all__: list[str] = []

NONE, FIRST, ALL = 0, 1, 2

def torch_rule(name: str, group: Mapping[str, Any]) -> int:
    """How torch.optim's class ``name`` reads its per-param step count in ``group``."""
    if name in ("Adam", "AdamW", "NAdam", "RAdam", "Adamax"):
        return ALL
    if name == "Adagrad":
        return ALL if group.get("lr_decay", 0) != 0 else NONE
    if name == "SGD":
        return FIRST if group.get("momentum", 0) != 0 and group.get("dampening", 0) != 0 \
            else NONE
    return NONE  # RMSprop, Adadelta, Rprop


MISSED_STEPS = (
    "{owner}: {where} has a gradient at this step, but had none at {missed} of the "
    "{steps} earlier steps of its transform. torch.optim counts steps per param (its step "
    "count for this param would be {own}); this optimizer's transform counts them per group "
    "(it would use {group}), and {why}, so the update would differ from torch.optim's. "
    "Fix: give the param a zero gradient on the steps where it has none (zero_grad("
    "set_to_none=False), or p.grad = torch.zeros_like(p)), or {separate}."
)
_WHY = {ALL: "its rule reads the count at every step (bias correction)",
        FIRST: "its rule takes a param's first step apart (undamped momentum)"}


class MissedSteps:
    """Per group (a key), the number of its steps each param had no gradient in."""

    def __init__(self) -> None:
        self.missed: dict[Any, dict[int, int]] = {}  # key -> {param index: steps missed}
        self.steps: dict[Any, int] = {}  # key -> steps the group's transform took

    def check(self, owner: str, key: Any, grads: list[Any], rule: Callable[[], int],
              describe: Callable[[int], str], separate: str) -> None:
        """Raise if a param with a gradient in ``grads`` would step otherwise than in
        torch.optim (``rule()`` is asked only when a param that missed steps steps now)."""
        missed = self.missed.get(key)
        if not missed:
            return
        steps = self.steps.get(key, 0)
        late = [(j, n) for j, n in missed.items() if grads[j] is not None]
        if not late:
            return
        how = rule()
        for j, n in late:
            if how == ALL or (how == FIRST and n == steps):
                raise ValueError(MISSED_STEPS.format(
                    owner=owner, where=describe(j), missed=n, steps=steps,
                    own=steps - n + 1, group=steps + 1, why=_WHY[how], separate=separate))

    def advance(self, key: Any, missing: list[int]) -> None:
        """The group's transform took a step; the params at ``missing`` had no gradient."""
        self.steps[key] = self.steps.get(key, 0) + 1
        if missing:
            missed = self.missed.setdefault(key, {})
            for j in missing:
                missed[j] = missed.get(j, 0) + 1

    def reset(self, key: Any | None = None) -> None:
        """The group's state starts again from one count for all (every group's: None)."""
        if key is None:
            self.missed.clear()
            self.steps.clear()
        else:
            self.missed.pop(key, None)
            self.steps.pop(key, None)


class TorchCounts:
    """``MissedSteps`` for a facade running a translated torch.optim optimizer's rule over
    all its params at once: its transform's counts advance at every step it takes, so a
    group of params without gradients still counts the step."""

    def __init__(self, optimizer: Any, params: list[Any]) -> None:
        name = type(optimizer).__name__
        by_id = {id(p): torch_rule(name, group)
                 for group in optimizer.param_groups for p in group["params"]}
        self.rules = [by_id.get(id(p), NONE) for p in params]
        self.missed = MissedSteps()

    def check(self, owner: str, grads: list[Any], names: list[str]) -> None:
        """Raise before a step that would differ from the torch optimizer's (see
        ``MissedSteps.check``)."""
        missed = self.missed.missed.get(0)
        if not missed:
            return
        late = [j for j in missed if grads[j] is not None]
        for how in sorted({self.rules[j] for j in late}, reverse=True):
            self.missed.check(owner, 0, [g if self.rules[j] == how else None
                                         for j, g in enumerate(grads)],
                              functools.partial(int, how), lambda j: f"param {names[j]!r}",
                              "build a separate optimizer for the params that miss steps")

    def advance(self, grads: list[Any]) -> None:
        """A step was taken (not skipped) with these gradients."""
        self.missed.advance(0, [j for j, g in enumerate(grads) if g is None])
