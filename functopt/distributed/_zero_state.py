"""The state type of ZeRO-1 (told apart from an unsharded mixed-precision state), and the
mesh its checkpoint entries are DTensors on."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from functopt.precision.step import MixedPrecisionState


class Zero1State(MixedPrecisionState):
    """A [`MixedPrecisionState`][functopt.precision.MixedPrecisionState] whose per-param
    fields hold this rank's 1-D slices (the state of [`zero1`][functopt.distributed.zero1]).

    Its fields, and so its checkpoint keys, are ``MixedPrecisionState``'s; the type exists so
    that the generic [`state_to_dict`][functopt.distributed.state_to_dict] refuses it: the
    slices would be saved as plain tensors, which DCP keeps once for all ranks.
    """

    __slots__ = ()


ZERO1_STATE_REFUSED = (
    "{owner}: {what} is the state of zero1 (this rank's 1-D slices of each param's master "
    "and moments). The generic state dict helpers would save the slices as plain tensors, "
    "which torch.distributed.checkpoint keeps once for all ranks, so every rank but one "
    "would load another rank's slices. Fix: use zero1_state_to_dict(state, params) and "
    "zero1_state_from_dict(d, template, params), which save each slice at its offset."
)


_meshes: dict[tuple[int, str], tuple[dist.ProcessGroup, Any]] = {}


def mesh_of(group: dist.ProcessGroup, device_type: str) -> Any:
    """The 1-D ``DeviceMesh`` over ``group`` (built once per group and device type)."""
    cached = _meshes.get((id(group), device_type))
    if cached is None or cached[0] is not group:  # (an id can be reused by a new group)
        from torch.distributed.device_mesh import DeviceMesh  # (importing it costs 0.7 s)

        cached = _meshes[(id(group), device_type)] = (
            group, DeviceMesh.from_group(group, device_type))
    return cached[1]
