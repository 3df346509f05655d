"""Distributed support: statistics of sharded (DTensor) gradients in one collective.

When params are DTensors (FSDP2's ``fully_shard``), every functopt transform keeps working
unchanged: its state leaves are DTensors with the params' mesh and placements, and its
elementwise maths runs on the local shards without communication. What needs the process
group is a reduction over all elements. [`global_grad_stats`][functopt.distributed.global_grad_stats]
computes the global sum of squares, non-finite count and zero count of all gradients with
one ``all_reduce``, counting each element once: DTensor leaves replicated over a mesh
dimension by their placements, plain tensors (a param left out of a tensor-parallel plan,
dense params beside expert-parallel ones, pipeline stages) by a ``replicated``
declaration;
[`mixed_precision`][functopt.precision.mixed_precision] uses it, so a distributed
mixed-precision step makes exactly one collective and an overflow on any rank skips the
step on every rank. [`state_to_dict`][functopt.distributed.state_to_dict] and
[`state_from_dict`][functopt.distributed.state_from_dict] turn any state into a flat dict of
tensors with readable keys for ``torch.distributed.checkpoint`` (which reshards it), and
[`offload`][functopt.distributed.offload] / [`reload`][functopt.distributed.reload] move a
state to host memory and back, reusing buffers. [`zero1`][functopt.distributed.zero1] is
ZeRO-1 for replicated params: the mixed-precision step with its state sharded over the
data-parallel ranks, with checkpoints that reshard
([`zero1_state_to_dict`][functopt.distributed.zero1_state_to_dict]) and reduce-scattered
gradients ([`zero1_reduce_scatter`][functopt.distributed.zero1_reduce_scatter]);
[`zero1_overlapped`][functopt.distributed.zero1_overlapped] makes the same step with the
parameter all-gather left in flight for the next forward to wait on.

The sharding strategies (ZeRO-1, checkpoints, offload) sit above ``functopt.precision``,
whose step ZeRO-1 wraps. The packed reductions they and the transforms share live in the
private low layer ``functopt._collective`` and are re-exported here.
"""

from functopt._collective.dtensor import counted_here, infer_group, is_dtensor, local_tensor
from functopt._collective.stats import all_reduce_stats, global_grad_stats, local_grad_stats
from functopt.distributed.checkpoint import state_from_dict, state_to_dict
from functopt.distributed.offloading import OffloadedState, offload, reload
from functopt.distributed.overlap import OverlappedZero1, PendingParams, zero1_overlapped
from functopt.distributed.zero import (
    slice_bounds,
    zero1,
    zero1_reduce_scatter,
    zero1_state_from_dict,
    zero1_state_to_dict,
)

__all__ = [
    "OffloadedState",
    "OverlappedZero1",
    "PendingParams",
    "all_reduce_stats",
    "counted_here",
    "global_grad_stats",
    "infer_group",
    "is_dtensor",
    "local_grad_stats",
    "local_tensor",
    "offload",
    "reload",
    "slice_bounds",
    "state_from_dict",
    "state_to_dict",
    "zero1",
    "zero1_overlapped",
    "zero1_reduce_scatter",
    "zero1_state_from_dict",
    "zero1_state_to_dict",
]
