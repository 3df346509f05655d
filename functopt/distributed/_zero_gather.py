r"""ZeRO-1's parameter all-gather: every rank's new slices land in the new params themselves.

Rank $r$ of $N$ owns elements $[\min(rc, n), \min((r+1)c, n))$ of a flattened leaf of $n$
elements, $c = \lceil n / N \rceil$ (``torch.chunk``'s split, see ``zero.py``). The new
param is allocated with $N c$ elements (at most $N - 1$ past the leaf), so every rank's
part is exactly $c$ elements at offset $rc$: the gather of a leaf is one
``all_gather_into_tensor`` whose output is that allocation and whose input is this rank's
own part of it, where the rank has copied its new slice (the in-place form of the
all-gather, which NCCL and gloo take). The new param is the first $n$ elements, viewed in
the param's shape. All leaves' gathers are issued as one coalesced collective (torch's
``_coalescing_manager``: one ``allgather_into_tensor_coalesced`` on gloo, one NCCL group),
on the leaves' bytes, so params of several dtypes travel together.

So the gather allocates the new params and nothing beside them: no packed send buffer, no
receive buffer to copy out of. (A backend may add temporaries of its own: gloo's coalesced
all-gather, in torch 2.13, flattens the inputs and outputs into buffers it copies back
from; NCCL's issues one in-place all-gather per tensor inside one group.) Its host work is
a few Python operations per leaf (an allocation, the copy of this rank's slice, two views,
the collective's entry) and none per rank: the step's Python time does not grow with the
number of ranks.

Every collective of the step is bounded: ``timeout`` seconds for each wait, after which
(or when the backend reports a rank gone) the error names zero1's collective, the group's
ranks, the timeout and the fix (``functopt/_collective/agreement.py``'s mechanism, with
zero1's words).
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _coalescing_manager

from functopt._collective.agreement import Agreement, Wording, annotated, wait_all

ZERO1_TIMEOUT_S = 600.0
"""The default bound on each of zero1's collectives, in seconds (NCCL's default timeout)."""

ZERO1_WORDING = Wording(
    timed_out=(
        "functopt: the {what} of zero1's step (over {world} ranks: {ranks}) did not complete "
        "within timeout={timeout:g} s: a rank of the group has not reached it (it died, "
        "hangs, or skipped step()). Every rank of the group must call step() the same "
        "number of times. Fix: find the rank that stopped (its own log or traceback); pass "
        "a larger timeout= to zero1 if a rank is only slow. The process group cannot be "
        "used after this error (the other ranks' collective is still pending): restart "
        "every rank from the last checkpoint (zero1_state_from_dict)."
    ),
    failed=(
        "functopt: the {what} of zero1's step (over {world} ranks: {ranks}) failed: a rank "
        "died or left the step (the backend's error above). The ranks still alive cannot "
        "go on. Fix: restart every rank from the last checkpoint (zero1_state_from_dict)."
    ),
)
GATHER = "all_gather of the new params"
STATS = "all_reduce of the gradient statistics"


def bound(group: dist.ProcessGroup, timeout_s: float) -> Agreement:
    """The bound of zero1's collectives over ``group``: ``timeout_s`` and zero1's words."""
    return Agreement(group, datetime.timedelta(seconds=timeout_s), ZERO1_WORDING)


def _gather_into(out: torch.Tensor, part: torch.Tensor, group: dist.ProcessGroup, *,
                 async_op: bool = False) -> Any:
    gather = getattr(dist, "all_gather_single", None)  # torch >= 2.13; the old name warns
    if gather is None:  # pragma: no cover - older torch
        gather = dist.all_gather_into_tensor
    return gather(out, part, group=group, async_op=async_op)


def start_gather(new_slices: list[Any], local: list[Any], rank: int, world: int,
                 group: dist.ProcessGroup, limit: Agreement, *, alone: bool = True,
                 ) -> tuple[list[Any], list[Any]]:
    """Start gathering every rank's ``new_slices`` (1-D, rank ``rank``'s of each leaf of
    ``local``) into new tensors shaped like ``local``: ``(new tensors, handles)``; the new
    tensors hold the gathered values once the handles are waited for (``wait_all``).

    ``alone``: no other gather of this kind is in flight on the group until this one is
    waited for. Where several are (``zero1_overlapped``'s buckets) and the leaves are on
    the CPU, each leaf is its own asynchronous all-gather instead of one coalesced call:
    gloo's coalesced all-gathers (torch 2.13) corrupt the heap when two run at once on
    its worker threads (glibc aborts with ``malloc(): unaligned tcache chunk detected``;
    reproduced within a few thousand steps of two ranks), where its plain all-gathers do
    not."""
    full: list[Any] = []
    parts: list[tuple[torch.Tensor, torch.Tensor]] = []
    for p, s in zip(local, new_slices, strict=True):
        if p is None:
            full.append(None)
            continue
        n = p.numel()
        c = -(-n // world)
        if c == 0:  # an empty leaf: nothing to gather
            full.append(s.reshape(p.shape))
            continue
        padded = torch.empty(world * c, dtype=p.dtype, device=p.device)
        start = min(rank * c, n)
        padded[rank * c:rank * c + min((rank + 1) * c, n) - start].copy_(s.reshape(-1))
        raw = padded.view(torch.uint8)  # one collective for every dtype: their bytes
        size = p.element_size()
        parts.append((raw, raw[rank * c * size:(rank + 1) * c * size]))
        full.append(padded[:n].view(p.shape))
    if not parts:
        return full, []
    if not alone and parts[0][0].device.type == "cpu":
        with annotated(limit, GATHER):
            return full, [_gather_into(out, part, group, async_op=True) for out, part in parts]
    with annotated(limit, GATHER), _coalescing_manager(group, async_ops=True) as coalesced:
        for out, part in parts:
            _gather_into(out, part, group)
    return full, list(coalesced.works)


def gather(new_slices: list[Any], local: list[Any], rank: int, world: int,
           group: dist.ProcessGroup | None, limit: Agreement | None) -> list[Any]:
    """Every rank's new slices of every leaf, as full tensors shaped like ``local``: one
    coalesced all-gather, waited for within ``limit``; without a group, the slices reshaped."""
    if group is None or world == 1 or limit is None:
        return [None if p is None else s.reshape(p.shape)
                for p, s in zip(local, new_slices, strict=True)]
    full, works = start_gather(new_slices, local, rank, world, group, limit)
    wait_all(works, limit, GATHER)
    return full
