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
state to host memory and back, reusing buffers. ZeRO-1 for replicated params sits one layer
up, as [`functopt.precision.zero1`][functopt.precision.zero1], since it is built on the
mixed-precision step.
"""

from functopt.distributed.checkpoint import state_from_dict, state_to_dict
from functopt.distributed.dtensor import counted_here, infer_group, is_dtensor, local_tensor
from functopt.distributed.offloading import OffloadedState, offload, reload
from functopt.distributed.reduce import all_reduce_stats, global_grad_stats, local_grad_stats

__all__ = [
    "OffloadedState",
    "all_reduce_stats",
    "counted_here",
    "global_grad_stats",
    "infer_group",
    "is_dtensor",
    "local_grad_stats",
    "local_tensor",
    "offload",
    "reload",
    "state_from_dict",
    "state_to_dict",
]
