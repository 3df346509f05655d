r"""Every rank takes the same skip decision: the overflow verdict agreed over a process group.

A mixed-precision step skips when its gradients overflow. Where the statistics are summed
over a group (DTensor params, or a declared ``process_group``), the summed non-finite
count already gives every rank of that group the same verdict. Where they are not (plain
tensors, each rank reading only its own: Megatron-style tensor-parallel slices, or
gradients that DDP replicates), a nan on one rank would make that rank skip and halve its
loss scale while the others step, and the ranks would diverge. The agreement makes the
verdict a sum over a group too, as ``torch.distributed.fsdp.sharded_grad_scaler`` does
with its ``found_inf``, without touching the norm (summing the squared norms of
replicated gradients would count them once per rank):

- the statistics' group spans the agreement group: nothing is added, the one all-reduce of
  the statistics agrees the verdict (FSDP2 over every rank: still one collective a step);
- no statistics group: one all-reduce of one float64, this rank's verdict (0 or 1), over
  the agreement group, which takes the place of the non-finite count in the statistics
  (the number of ranks that overflowed; only its sign is read);
- a statistics group smaller than the agreement group (a tensor-parallel group inside the
  default group): the statistics' all-reduce, then the verdict's (two collectives; pass
  ``agree_skip=`` that group to make it one).

Each collective the agreement waits for is bounded by its timeout: a rank that never
reaches the step (it skipped ``step()``, or the optimizer steps on some ranks only) makes
the others raise within it, saying so, rather than block for the process group's timeout.
The same bound serves ZeRO-1's collectives (``functopt/distributed/zero.py``): an
``Agreement`` carries the words of its errors (a ``Wording``), so a timed-out or
failed collective names the step it belongs to and the argument that bounds it.
"""

from __future__ import annotations

import contextlib
import datetime
import math
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from functopt._collective.counting import _group_ranks, _non_member
from functopt._collective.stats import (
    COLLECTIVE_FAILED,
    NONFINITE,
    all_reduce_stats,
    norm_and_overflow,
    raise_with_note,
)

__all__ = ["AGREE_TIMEOUT_S", "SKIP_AGREEMENT", "Agreement", "Wording", "agreement",
           "annotated", "check_agreement", "check_timeout", "reduce_stats", "spans",
           "threshold_verdict", "wait_all"]

AGREE_TIMEOUT_S = 600.0
"""The default bound on the agreement's collective, in seconds (NCCL's default timeout)."""

AGREEMENT_TIMED_OUT = (
    "functopt: the {what} that agrees the skip decision of the mixed-precision step "
    "(over {world} ranks) did not complete within agree_timeout={timeout:g} s: a rank of "
    "the group has not reached this step. Likely causes: a rank skipped step() (every rank "
    "of the group must call it, the same number of times), or this optimizer steps on a "
    "subset of the ranks (an RLHF actor and critic stepping at different times). Fix: call "
    "step() on every rank; for an optimizer that steps on a subset of ranks pass "
    "agree_skip=<the group of those ranks>, or agree_skip=False where no rank can overflow "
    "alone; raise agree_timeout= if a rank is only slow. The process group cannot be used "
    "after this error (the other ranks' collective is still pending): restart every rank."
)



class Wording(NamedTuple):
    """The errors of a bounded collective: message templates with the fields ``what`` (the
    collective), ``world`` (the group's size), ``ranks`` (its ranks) and ``timeout`` (s)."""

    timed_out: str  # the collective did not complete within the bound
    failed: str  # the backend raised (a rank died, or left the step)


SKIP_AGREEMENT = Wording(AGREEMENT_TIMED_OUT, COLLECTIVE_FAILED)
"""The words of the skip agreement of ``mixed_precision`` and ``MixedPrecisionOptimizer``."""


class Agreement(NamedTuple):
    """Where the skip decision is agreed, how long its collective may take, and what its
    errors say."""

    group: dist.ProcessGroup  # the ranks that agree (a group of more than one rank)
    timeout: datetime.timedelta  # the bound on waiting for its collective
    wording: Wording = SKIP_AGREEMENT


def check_agreement(owner: str, agree_skip: Any, agree_timeout: Any) -> float | None:
    """Validate ``agree_skip`` and ``agree_timeout`` as given; return the timeout in
    seconds (None where there is no agreement)."""
    if _non_member(agree_skip):
        raise ValueError(
            f"{owner}: agree_skip is GroupMember.NON_GROUP_MEMBER, what "
            f"torch.distributed.new_group returns on the ranks outside the new group: this "
            f"rank ({dist.get_rank()}) would agree over a group it is not in. Fix: build this "
            f"optimizer only on the ranks of that group (the ones that step it)."
        )
    if not isinstance(agree_skip, (bool, dist.ProcessGroup)):
        raise TypeError(
            f"{owner}: agree_skip must be True (agree the skip decision over the default "
            f"process group), False (no agreement) or a torch.distributed.ProcessGroup (agree "
            f"over its ranks), got {type(agree_skip).__name__} {agree_skip!r}."
        )
    if agree_skip is False:
        if agree_timeout is not None:
            raise ValueError(
                f"{owner}: agree_timeout={agree_timeout!r} bounds the collective that agrees "
                f"the skip decision, but agree_skip=False makes none. Fix: drop agree_timeout, "
                f"or pass agree_skip=True (or a group)."
            )
        return None
    return check_timeout(owner, "agree_timeout", agree_timeout, AGREE_TIMEOUT_S)


def check_timeout(owner: str, name: str, value: Any, default: float) -> float:
    """``value`` (seconds or a ``datetime.timedelta``; ``None``: ``default``) in seconds,
    raising, naming the argument ``name``, unless it is finite and positive."""
    if value is None:
        return default
    seconds = value.total_seconds() if isinstance(value, datetime.timedelta) else value
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (
            math.isfinite(seconds) and seconds > 0):
        raise ValueError(
            f"{owner}: {name} must be a finite number of seconds > 0 or a "
            f"datetime.timedelta (default {default:g} s), got {value!r}."
        )
    return float(seconds)


def agreement(agree_skip: bool | dist.ProcessGroup, timeout_s: float | None,
              wording: Wording = SKIP_AGREEMENT) -> Agreement | None:
    """The agreement of a step now: None without one (``agree_skip=False``, or
    ``torch.distributed`` not initialized, or a group of one rank)."""
    if agree_skip is False or timeout_s is None or not (
            dist.is_available() and dist.is_initialized()):
        return None
    group = dist.group.WORLD if agree_skip is True else agree_skip
    assert isinstance(group, dist.ProcessGroup)
    if dist.get_rank(group) < 0:  # (a group of one other rank too)
        raise ValueError(
            f"functopt: the step's agree_skip is a process group this rank "
            f"({dist.get_rank()}) is not in. Fix: step this optimizer only on the ranks of "
            f"that group, or give each rank a group it belongs to."
        )
    if len(_group_ranks(group)) < 2:
        return None
    return Agreement(group, datetime.timedelta(seconds=timeout_s), wording)


def spans(group: dist.ProcessGroup | None, agreed: Agreement) -> bool:
    """Whether a sum over ``group`` reaches every rank of the agreement (agrees it)."""
    return group is not None and (group is agreed.group  # (no look-up of the ranks)
                                  or _group_ranks(agreed.group) <= _group_ranks(group))


def threshold_verdict(norm: torch.Tensor, found_inf: torch.Tensor, threshold: float,
                      group: dist.ProcessGroup | None, agree_skip: bool | dist.ProcessGroup,
                      timeout_s: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(over, found)`` of a step with a norm threshold (``grad_norm_skip_threshold``):
    whether the finite ``norm`` exceeds ``threshold``, and the overflow verdict, both the
    same on every rank of the agreement. Where the statistics were summed over a group
    spanning it they are already; otherwise one all-reduce of two float64s makes them so
    (a rank that skips for the norm while another takes the step, whose agreement it would
    never meet, would leave that one waiting)."""
    over = torch.isfinite(norm) & (norm > threshold)
    agreed = agreement(agree_skip, timeout_s)
    if agreed is None or spans(group, agreed):
        return over, found_inf
    local = torch.stack([over.to(torch.float64), found_inf.to(torch.float64)])
    summed = _bounded(local, agreed.group, agreed, "all_reduce of the norm threshold's verdict")
    return summed[0] > 0, summed[1] > 0


def reduce_stats(local: torch.Tensor, group: dist.ProcessGroup | None,
                 agreed: Agreement | None) -> torch.Tensor:
    """The packed statistics ``local`` summed over ``group`` (None: not summed), with the
    overflow verdict agreed over ``agreed.group`` (see the module docstring).

    ``local`` is left unchanged."""
    if agreed is None:
        return all_reduce_stats(local, group)
    packed = local if group is None else _bounded(local, group, agreed, "all_reduce of the "
                                                   "gradient statistics")
    if spans(group, agreed):
        return packed
    _, found = norm_and_overflow(packed)  # (this rank's verdict, as unpack_grad_stats')
    verdict = _bounded(found.to(torch.float64).reshape(1), agreed.group, agreed,
                       "all_reduce of the overflow verdict")
    out = packed.clone() if packed is local else packed
    out[NONFINITE] = verdict[0]
    return out


def _bounded(tensor: torch.Tensor, group: dist.ProcessGroup, agreed: Agreement,
             what: str) -> torch.Tensor:
    """The sum of ``tensor`` over ``group``, waited for at most ``agreed.timeout``."""
    out = tensor.clone()
    bound = agreed._replace(group=group)
    with annotated(bound, what):
        work = dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group, async_op=True)
    wait_all([work], bound, what)
    return out


@contextlib.contextmanager
def annotated(bound: Agreement, what: str) -> Iterator[None]:
    """Re-raise a ``RuntimeError`` of the block (gloo's and NCCL's ``DistBackendError`` keep
    their type) with ``bound.wording``'s note about the collective ``what``: its timed-out
    note where the backend says it timed out, its failed note otherwise."""
    try:
        yield
    except RuntimeError as exc:
        timed_out = "timed out" in str(exc).lower() or "timeout" in str(exc).lower()
        template = bound.wording.timed_out if timed_out else bound.wording.failed
        ranks = sorted(_group_ranks(bound.group))
        shown = (str(ranks) if len(ranks) <= 8
                 else f"[{', '.join(map(str, ranks[:4]))}, ..., {ranks[-1]}]")
        raise_with_note(exc, template.format(what=what, world=len(ranks), ranks=shown,
                                             timeout=bound.timeout.total_seconds()))


def wait_all(works: list[Any], bound: Agreement, what: str) -> None:
    """Wait for the handles ``works`` of collectives over ``bound.group``, each at most
    ``bound.timeout``, their errors annotated as ``annotated`` words them."""
    with annotated(bound, what):
        for work in works:
            if work is not None:
                work.wait(timeout=bound.timeout)
