"""Distributed support: statistics of sharded (DTensor) gradients in one collective.

When params are DTensors (FSDP2's ``fully_shard``), every functopt transform keeps working
unchanged: its state leaves are DTensors with the params' mesh and placements, and its
elementwise maths runs on the local shards without communication. What needs the process
group is a reduction over all elements. [`global_grad_stats`][functopt.distributed.global_grad_stats]
computes the global sum of squares, non-finite count and zero count of all gradients with
one ``all_reduce``, counting leaves replicated over a mesh dimension once;
[`mixed_precision`][functopt.precision.mixed_precision] uses it, so a distributed
mixed-precision step makes exactly one collective and an overflow on any rank skips the
step on every rank.
"""

from functopt.distributed.dtensor import counted_here, infer_group, is_dtensor, local_tensor
from functopt.distributed.reduce import all_reduce_stats, global_grad_stats, local_grad_stats

__all__ = [
    "all_reduce_stats",
    "counted_here",
    "global_grad_stats",
    "infer_group",
    "is_dtensor",
    "local_grad_stats",
    "local_tensor",
]
