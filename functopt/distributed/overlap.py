r"""ZeRO-1 whose parameter all-gather overlaps the next forward (Megatron's ``overlap_param_gather``).

[`zero1`][functopt.distributed.zero1] ends its step with one blocking ``all_gather`` of
the new slices: every rank waits for all params before it returns them.
[`zero1_overlapped`][functopt.distributed.zero1_overlapped] makes the same step but only
*starts* the gather: the leaves are packed into buckets of about ``bucket_bytes`` per rank
(in the params' order), one asynchronous ``all_gather`` per bucket is launched (per leaf
on CPU tensors: gloo's coalesced all-gathers are unsafe several at once), and the
step returns a [`PendingParams`][functopt.distributed.PendingParams] instead of the
params. Its ``wait()`` gives the params (bitwise those of ``zero1``); its ``attach(module)``
installs forward pre-hooks that wait, module by module, only for the buckets holding that
module's params and copy them in, so the first layers compute while the later buckets are
still on the wire. With the params in forward order (``named_parameters`` of most
models), the forward then waits for the first bucket only, plus any bucket that is slower
to arrive than the layers before it take to run.

The arithmetic is ``zero1``'s, the gather only cut into pieces, so params, masters and
state are bitwise those of ``zero1``; the collectives per step are one ``all_reduce`` and
one ``all_gather`` per bucket (per leaf on gloo).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from functopt._base import GradientTransformation, Params
from functopt._collective.agreement import wait_all
from functopt._collective.counting import Replicated
from functopt.distributed._zero_gather import GATHER, start_gather
from functopt.distributed.zero import _Plan, _rewrap, _zero1_parts
from functopt.precision.loss_scale import LossScale
from functopt.precision.master import MasterWeights
from functopt.precision.step import MixedPrecisionState
from functopt.tree import _core

__all__ = ["OverlappedZero1", "PendingParams", "zero1_overlapped"]


class _Bucket(NamedTuple):
    leaves: list[int]  # indices into the params' leaves
    full: list[Any]  # their new local tensors, filled by the all-gather in flight
    works: list[Any]  # the all-gather's handles (empty: no group, nothing gathered)


class PendingParams:
    """The new params of a [`zero1_overlapped`][functopt.distributed.zero1_overlapped] step, on their way.

    ``wait()`` blocks until every bucket has arrived and returns the full params (as
    [`zero1`][functopt.distributed.zero1]'s step returns them); ``attach(module)`` lets the
    module's forward wait for them piece by piece. Every bucket is waited for once; the
    pieces already unpacked are kept.

    Examples:
        >>> import torch, functopt
        >>> from functopt.distributed import zero1_overlapped
        >>> opt = zero1_overlapped(functopt.sgd(0.5))  # no process group: nothing to gather
        >>> params = {"w": torch.ones(2)}
        >>> pending, state = opt.step({"w": torch.ones(2)}, opt.init(params), params)
        >>> pending.wait()
        {'w': tensor([0.5000, 0.5000])}
    """

    def __init__(self, plan: _Plan, new_leaves: list[Any], buckets: list[_Bucket]) -> None:
        self._plan = plan
        self._buckets = buckets
        self._bucket_of = {i: b for b, bucket in enumerate(buckets) for i in bucket.leaves}
        self._full: list[Any] = [None] * len(plan.leaves)
        self._arrived = [False] * len(buckets)
        self._index = {p: i for i, p in enumerate(_core.paths(plan.treespec))}
        if plan.group is None:  # one rank: the slices are the leaves
            self._full = _rewrap(plan.leaves, [
                None if p is None else s.reshape(p.shape)
                for p, s in zip(plan.local, new_leaves, strict=True)])
            self._arrived = [True] * len(buckets)

    def _arrive(self, b: int) -> None:
        if self._arrived[b]:
            return
        bucket = self._buckets[b]
        assert self._plan.limit is not None  # (a group: buckets in flight)
        wait_all(bucket.works, self._plan.limit, GATHER)
        for i, t in zip(bucket.leaves, _rewrap([self._plan.leaves[i] for i in bucket.leaves],
                                               bucket.full), strict=True):
            self._full[i] = t
        self._arrived[b] = True

    @property
    def arrived(self) -> bool:
        """Whether every bucket has arrived (and been unpacked)."""
        return all(self._arrived)

    @property
    def arrived_buckets(self) -> int:
        """How many buckets have arrived so far."""
        return sum(self._arrived)

    def leaf(self, path: str) -> torch.Tensor | None:
        """The new value of the param at ``path`` (as ``functopt.tree`` names it, e.g.
        ``'blocks.0.weight'``), waiting only for its bucket."""
        paths = self._paths()
        if path not in paths:
            raise KeyError(
                f"PendingParams.leaf: no param at {path!r}; the params' paths are "
                f"{sorted(paths)[:8]}{' ...' if len(paths) > 8 else ''}."
            )
        i = paths[path]
        if i in self._bucket_of:
            self._arrive(self._bucket_of[i])
        return self._full[i]  # type: ignore[no-any-return]

    def _paths(self) -> dict[str, int]:
        return self._index

    def wait(self) -> Params:
        """Every bucket's params, once all have arrived: the full params, as ``zero1`` gives."""
        for b in range(len(self._buckets)):
            self._arrive(b)
        return _core.unflatten(self._plan.treespec, self._full)

    def attach(self, module: torch.nn.Module) -> list[Any]:
        """Copy the new params into ``module``'s parameters as its forward reaches them.

        Each submodule that owns parameters gets a forward pre-hook that waits for the
        buckets of its own parameters, copies their new values in (``param.copy_``, under
        ``torch.no_grad``) and removes itself; parameters are matched to the params' leaves
        by their ``named_parameters`` names, which must be the params' paths (as with
        ``params = {n: p.detach() for n, p in module.named_parameters()}``). Call the
        forward before the next step, or ``wait()``.

        Returns:
            The hooks' handles (already removed once they ran).

        Raises:
            ValueError: a leaf of the params is no parameter of ``module`` (naming it).
        """
        paths = self._paths()
        names = {n for n, _ in module.named_parameters()}
        missing = [p for p, i in paths.items() if self._plan.leaves[i] is not None
                   and p not in names]
        if missing:
            raise ValueError(
                f"PendingParams.attach: params leaves {missing[:5]} are not parameters of the "
                f"module (by named_parameters). Fix: build the params as "
                f"{{n: p.detach() for n, p in module.named_parameters()}}, or call wait() "
                f"and copy the params yourself."
            )
        handles: list[Any] = []
        for prefix, sub in module.named_modules():
            own = [(f"{prefix}.{n}" if prefix else n, p)
                   for n, p in sub.named_parameters(recurse=False)]
            own = [(n, p) for n, p in own if n in paths]
            if not own:
                continue

            box: list[Any] = []  # the hook's own handle, for it to remove itself

            def hook(_module: torch.nn.Module, _inputs: Any,
                     own: list[tuple[str, torch.nn.Parameter]] = own,
                     box: list[Any] = box) -> None:
                with torch.no_grad():
                    for n, p in own:
                        new = self.leaf(n)
                        if new is not None:
                            p.copy_(new)
                box[0].remove()

            box.append(sub.register_forward_pre_hook(hook))
            handles.append(box[0])
        return handles


class OverlappedZero1(NamedTuple):
    """``init(params) -> state`` and ``step(grads, state, params) -> (PendingParams, state)``."""

    init: Callable[[Params], MixedPrecisionState]
    step: Callable[..., tuple[PendingParams, MixedPrecisionState]]
    buffers: Callable[[], list[torch.Tensor]]


def _buckets(local: list[Any], leaves: list[Any], world: int, bucket_bytes: int,
             ) -> list[list[int]]:
    """Consecutive non-``None`` leaves, cut where a rank's slices pass ``bucket_bytes``."""
    out: list[list[int]] = []
    size = 0
    for i, p in enumerate(local):
        if p is None or leaves[i] is None:
            continue
        nbytes = -(-p.numel() // world) * p.element_size()
        if not out or size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(i)
        size += nbytes
    return out


def zero1_overlapped(
    inner: GradientTransformation,
    *,
    bucket_bytes: int = 1 << 22,
    process_group: dist.ProcessGroup | None = None,
    stats_group: dist.ProcessGroup | None = None,
    replicated: Replicated = None,
    loss_scale: LossScale | None = None,
    master_weights: MasterWeights | None = None,
    max_grad_norm: float | torch.Tensor | None = None,
    fused: bool = True,
    timeout: float | datetime.timedelta | None = None,
) -> OverlappedZero1:
    r"""[`zero1`][functopt.distributed.zero1] whose parameter all-gather runs while the next forward starts.

    The same step as ``zero1`` with the same arguments (state, checkpoints through
    [`zero1_state_to_dict`][functopt.distributed.zero1_state_to_dict], full or
    reduce-scattered gradients), except that ``step`` returns a
    [`PendingParams`][functopt.distributed.PendingParams] in place of the params: the
    all-gathers of the new slices, one per bucket of about ``bucket_bytes`` per rank (one
    per leaf on CPU tensors, which gloo carries), are
    in flight. ``pending.attach(model)`` makes each submodule's forward wait for its own
    params and copy them in; ``pending.wait()`` returns them all. Results are bitwise
    ``zero1``'s.

    Args:
        inner: the elementwise update rule, as in ``zero1``.
        bucket_bytes: the most bytes of one rank's slices per all-gather (a leaf larger than
            that is a bucket of its own). Fewer, larger buckets pay less latency; more,
            smaller ones let the forward start sooner. Megatron-LM's default bucket is
            40M elements.
        process_group: as in ``zero1``.
        stats_group: as in ``zero1``.
        replicated: as in ``zero1``.
        loss_scale: as in ``zero1``.
        master_weights: as in ``zero1``.
        max_grad_norm: as in ``zero1``.
        fused: as in ``zero1``.
        timeout: as in ``zero1``: bounds the statistics' all-reduce and each bucket's
            wait (in ``wait()`` or a forward pre-hook).

    Returns:
        An [`OverlappedZero1`][functopt.distributed.OverlappedZero1].

    Raises:
        ValueError: ``bucket_bytes`` is not positive; and ``zero1``'s errors.

    Examples:
        >>> import torch, functopt
        >>> from functopt.distributed import zero1_overlapped
        >>> model = torch.nn.Linear(2, 1)
        >>> params = {n: p.detach().clone() for n, p in model.named_parameters()}
        >>> opt = zero1_overlapped(functopt.sgd(0.1))
        >>> grads = {n: torch.ones_like(p) for n, p in params.items()}
        >>> pending, state = opt.step(grads, opt.init(params), params)
        >>> handles = pending.attach(model)   # the forward copies the new params in
        >>> _ = model(torch.zeros(1, 2))
        >>> torch.equal(model.bias, pending.wait()["bias"])
        True
    """
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(
            f"zero1_overlapped: bucket_bytes must be a positive int (bytes of one rank's slices "
            f"per all-gather), got {bucket_bytes!r}."
        )
    init_fn, step_slices, buffers = _zero1_parts(
        "zero1_overlapped", inner, process_group=process_group, stats_group=stats_group,
        replicated=replicated, loss_scale=loss_scale, master_weights=master_weights,
        max_grad_norm=max_grad_norm, fused=fused, timeout=timeout)

    last: list[PendingParams] = []  # the previous step's params, which must have arrived

    def step_fn(grads: Any, state: MixedPrecisionState, params: Params,
                **extra_args: Any) -> tuple[PendingParams, MixedPrecisionState]:
        if last and not last[0].arrived:
            raise RuntimeError(
                "zero1_overlapped: the previous step's params are still being gathered "
                f"({last[0].arrived_buckets} of {len(last[0]._buckets)} buckets arrived), so "
                "the params passed now are not its result. Fix: call pending.wait(), or run "
                "the forward of the module given to pending.attach (every module owning "
                "params must run), before the next step."
            )
        pl, new_leaves, new_state = step_slices(grads, state, params, **extra_args)
        buckets: list[_Bucket] = []
        for indices in _buckets(pl.local, pl.leaves, pl.world, bucket_bytes):
            if pl.group is None or pl.limit is None:
                buckets.append(_Bucket(indices, [], []))
                continue
            full, works = start_gather([new_leaves[i] for i in indices],
                                       [pl.local[i] for i in indices], pl.rank, pl.world,
                                       pl.group, pl.limit, alone=False)
            buckets.append(_Bucket(indices, full, works))
        pending = PendingParams(pl, new_leaves, buckets)
        last[:] = [pending]
        return pending, new_state

    return OverlappedZero1(init_fn, step_fn, buffers)
