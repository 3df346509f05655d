"""Move optimizer state to host memory between steps and back, reusing the host buffers.

Training stacks free accelerator memory for other work (generation in RLHF, a reference
model) by moving the optimizer state to the host and back: LightRFT's
``offload_fsdp_optimizer`` / ``load_fsdp_optimizer``, Megatron-LM's ``offload_to_cpu`` /
``restore_from_cpu``. [`offload`][functopt.distributed.offload] does it for any functopt
state and returns the host buffers it wrote; handing them back to the next ``offload``
makes it copy into the same memory instead of allocating (a fresh host allocation of
hundreds of megabytes costs page faults, and pinning it costs more).
[`reload`][functopt.distributed.reload] copies the state back to the device.

When CUDA is available the host buffers are pinned (page-locked), so the copies run
asynchronously at full bus speed; ``offload`` waits for them before returning. Without
CUDA (the CPU build), "offloading" copies the state into the host buffers all the same:
the functions behave identically, only nothing is freed.

DTensor leaves (FSDP2) move their local shard; they come back as DTensors with the same
mesh, placements and global shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from functopt._collective.dtensor import is_dtensor
from functopt.tree import _core

__all__ = ["OffloadedState", "offload", "reload"]


@dataclass(frozen=True)
class OffloadedState:
    """A state held in host memory by [`offload`][functopt.distributed.offload].

    Attributes:
        state: the state's tree on the CPU: plain leaves are the host buffers, DTensor
            leaves are DTensors (same mesh, placements, global shape) over host buffers.
        devices: for each leaf (in flatten order), the device its tensor (or local shard)
            came from; ``None`` for a ``None`` leaf.

    Examples:
        >>> import torch, functopt
        >>> from functopt.distributed import offload
        >>> host, _ = offload(functopt.adam(0.1).init({"w": torch.ones(2)}))
        >>> host.devices, host.state[0].mu["w"].device
        ((device(type='cpu'), device(type='cpu'), device(type='cpu')), device(type='cpu'))
    """

    state: Any
    devices: tuple[torch.device | None, ...]


def _wrap(local: torch.Tensor, like: Any) -> Any:
    """``local`` as a DTensor with ``like``'s mesh, placements and global shape (no copy)."""
    from torch.distributed.tensor import DTensor

    if like.device_mesh.device_type == local.device.type:
        return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                                  shape=like.shape, stride=like.stride())
    # from_local would copy ``local`` to the mesh's device. A DTensor whose shard lives on
    # the host is what DTensor.to("cpu") makes too; build it over the buffer itself.
    return DTensor(local, like._spec, requires_grad=False)  # type: ignore[no-untyped-call]


def _leaves(owner: str, tree: Any) -> tuple[list[Any], _core.TreeSpec]:
    leaves, treespec = _core.flatten(tree)
    for i, leaf in enumerate(leaves):
        if leaf is not None and not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{owner}: the state leaf {_core.paths(treespec)[i]!r} is a "
                f"{type(leaf).__name__}; expected tensors, DTensors and None."
            )
    return leaves, treespec


def _check_buffers(owner: str, buffers: Any, locals_: list[torch.Tensor | None],
                   treespec: _core.TreeSpec, what: str) -> list[Any]:
    if not isinstance(buffers, tuple):  # another kind of value: the package's TypeError
        raise TypeError(
            f"{owner}: buffers must be the tuple a previous call returned (or None), got "
            f"{_core._describe(buffers)}. Fix: pass buffers=None to allocate new ones."
        )
    if len(buffers) != len(locals_):
        raise ValueError(
            f"{owner}: buffers must be the tuple of {len(locals_)} entries a previous call "
            f"returned for a state of this structure, got "
            f"{_core._describe(buffers)}. Fix: pass buffers=None to allocate new ones."
        )
    for i, (buf, local) in enumerate(zip(buffers, locals_, strict=True)):
        ok = (buf is None) == (local is None) and (
            local is None or (isinstance(buf, torch.Tensor) and buf.shape == local.shape
                              and buf.dtype == local.dtype))
        if not ok:
            raise ValueError(
                f"{owner}: the {what} buffer for {_core.paths(treespec)[i]!r} is "
                f"{_core._describe(buf)}, but the leaf is {_core._describe(local)}. Fix: reuse "
                f"buffers only for states of the same layout, or pass buffers=None."
            )
    return list(buffers)


def offload(state: Any, *, buffers: tuple[Any, ...] | None = None
            ) -> tuple[OffloadedState, tuple[Any, ...]]:
    """Copy ``state`` into host memory; reuse ``buffers`` from an earlier call if given.

    Every tensor leaf (a DTensor's local shard) is copied into a host buffer of its shape
    and dtype: with ``buffers=None`` new ones (pinned when CUDA is available), otherwise
    the given ones, written in place (no allocation). Leaves already on the CPU are
    copied too, so the offloaded state never aliases the live one. ``state`` is not
    changed; drop it afterwards to free the device memory.

    Args:
        state: a functopt state (tensors, DTensors and ``None``).
        buffers: the buffers a previous ``offload`` of a state of the same layout returned.

    Returns:
        ``(offloaded, buffers)``: the state on the host (pass it to
        [`reload`][functopt.distributed.reload]) and the tuple of host buffers, one per
        leaf (``None`` for a ``None`` leaf), to pass to the next call.

    Raises:
        TypeError: a leaf is not a tensor or None.
        TypeError: ``buffers`` is not a tuple.
        ValueError: ``buffers`` do not fit the state (naming the leaf).

    Examples:
        >>> import torch, functopt, functopt.testing
        >>> from functopt.distributed import offload, reload
        >>> state = functopt.adam(0.1).init({"w": torch.ones(2)})
        >>> host, buffers = offload(state)
        >>> host2, buffers2 = offload(state, buffers=buffers)  # no new allocation
        >>> buffers2[1] is buffers[1]
        True
        >>> functopt.testing.bitwise_equal(reload(host2, "cpu"), state)
        True
    """
    owner = "offload"
    leaves, treespec = _leaves(owner, state)
    locals_ = [None if x is None else x.to_local() if is_dtensor(x) else x for x in leaves]
    pin = torch.cuda.is_available()
    if buffers is None:
        bufs = [None if x is None else torch.empty(x.shape, dtype=x.dtype, device="cpu",
                                                   pin_memory=pin) for x in locals_]
    else:
        bufs = _check_buffers(owner, buffers, locals_, treespec, "host")
    cuda = False
    for buf, local in zip(bufs, locals_, strict=True):
        if local is not None and buf is not None:
            cuda = cuda or local.is_cuda
            buf.copy_(local, non_blocking=pin)
    if cuda:
        torch.cuda.synchronize()  # the host copies must be complete when they are read
    host = [b if b is None or not is_dtensor(x) else _wrap(b, x)
            for b, x in zip(bufs, leaves, strict=True)]
    devices = tuple(None if x is None else x.device for x in locals_)
    return OffloadedState(_core.unflatten(treespec, host), devices), tuple(bufs)


def reload(offloaded: OffloadedState, device: torch.device | str | None = None, *,
           buffers: Any = None) -> Any:
    """Copy an offloaded state back to the device: the inverse of [`offload`][functopt.distributed.offload].

    Args:
        offloaded: what ``offload`` returned.
        device: where the leaves that were not on the CPU go (default: the device each
            came from). Leaves that were on the CPU before ``offload`` (a step counter the
            state keeps there on purpose) return to the CPU.
        buffers: optional: a state of the same layout on the target devices (such as an
            earlier ``reload``'s result that is no longer used) whose tensors are written
            in place and returned, instead of allocating new ones. Its tensors are
            overwritten: donate only a state nothing else reads.

    Returns:
        The state, bitwise the offloaded one; DTensor leaves are DTensors again, with the
        same mesh, placements and global shape.

    Raises:
        TypeError: ``offloaded`` is not an ``OffloadedState``.
        TypeError: ``buffers`` is not a tuple.
        ValueError: ``buffers`` do not fit the state (naming the leaf).

    Examples:
        >>> import torch, functopt, functopt.testing
        >>> from functopt.distributed import offload, reload
        >>> state = functopt.sgd(0.1, momentum=0.9).init({"w": torch.ones(2)})
        >>> host, _ = offload(state)
        >>> back = reload(host)
        >>> functopt.testing.bitwise_equal(back, state)
        True
        >>> again = reload(host, buffers=back)  # writes into ``back``'s tensors
        >>> again[0].trace["w"] is back[0].trace["w"]
        True
    """
    owner = "reload"
    if not isinstance(offloaded, OffloadedState):
        raise TypeError(
            f"{owner}: expected the OffloadedState that offload() returned, got "
            f"{type(offloaded).__name__}."
        )
    leaves, treespec = _core.flatten(offloaded.state)
    locals_ = [None if x is None else x.to_local() if is_dtensor(x) else x for x in leaves]
    targets = [
        None if was is None else was if was.type == "cpu" or device is None
        else torch.device(device)
        for was in offloaded.devices
    ]
    if buffers is None:
        out = [None if x is None else x.to(t, copy=True, non_blocking=x.is_pinned())
               for x, t in zip(locals_, targets, strict=True)]
    else:
        given, _ = _leaves(owner, buffers)
        given_locals = [None if x is None else x.to_local() if is_dtensor(x) else x
                        for x in given]
        out = _check_buffers(owner, tuple(given_locals), locals_, treespec, "device")
        for buf, x, t in zip(out, locals_, targets, strict=True):
            if x is None or t is None:
                continue
            if buf.device.type != t.type or t.index not in (None, buf.device.index):
                raise ValueError(
                    f"{owner}: a device buffer is on {buf.device}, but its leaf goes to {t}. "
                    f"Fix: donate a state on the target devices, or pass buffers=None."
                )
            buf.copy_(x, non_blocking=x.is_pinned())
    state = [o if o is None or not is_dtensor(x) else _wrap(o, x)
             for o, x in zip(out, leaves, strict=True)]
    return _core.unflatten(treespec, state)


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``a`` and ``b`` name one device (an accelerator without index: its current one)."""
    if a.type != b.type:
        return False
    if a.type == "cpu" or a.index == b.index:
        return True
    current = torch.accelerator.current_device_index() if torch.accelerator.is_available() else 0
    return (a.index if a.index is not None else current) == (
        b.index if b.index is not None else current)


def _restore_target(owner: str, offloaded: OffloadedState,
                    device_id: torch.device | str | int | None
                   ) -> torch.device | None:
    """The device ``reload`` should put ``offloaded`` on for a restore to ``device_id``.

    A restore puts the state back beside the params it updates, so ``device_id`` must
    name the device the state came from (None: that device). An int is an accelerator
    index, as LightRFT's ``load_fsdp_optimizer(optimizer, device_id)`` takes it.

    Raises:
        TypeError: ``device_id`` is not a device, a str, an int or None.
        ValueError: ``device_id`` names no available device, or another device than the
            one the state came from.
    """
    if device_id is None:
        return None
    if isinstance(device_id, bool) or not isinstance(device_id, (torch.device, str, int)):
        raise TypeError(
            f"{owner}: device_id must be a torch.device, a str, an int or None, got "
            f"{type(device_id).__name__}."
        )
    try:
        target = torch.device(device_id)
    except RuntimeError as err:  # an int without an accelerator
        raise ValueError(
            f"{owner}: device_id={device_id!r} names an accelerator, but none is available "
            f"({err}). Fix: pass the device the state came from, or None."
        ) from err
    came = sorted({str(d) for d in offloaded.devices if d is not None and d.type != "cpu"})
    sources = [torch.device(d) for d in came] or [torch.device("cpu")]
    if any(not _same_device(d, target) for d in sources):
        raise ValueError(
            f"{owner}: device_id={device_id!r}, but the state came from {', '.join(map(str, sources))}, "
            f"where the params it updates are. Fix: pass device_id={str(sources[0])!r} or None; "
            f"to move the training to another device, build the optimizer there."
        )
    return target
