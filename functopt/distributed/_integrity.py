r"""An integrity record in a checkpoint dict: a torn or altered checkpoint raises at load.

``torch.distributed.checkpoint`` writes one data file per rank and the metadata last; a
save that dies while overwriting a checkpoint leaves some ranks' files of the new save
next to others of the old one, under the old metadata. When the files keep their sizes
(the same state, a later step), ``dcp.load`` reads a mix of the two steps without an error.
The protection therefore lives in the dict itself, so that it holds when ``dcp.save`` and
``dcp.load`` are called directly:

- [`state_to_dict`][functopt.distributed.state_to_dict] adds the entry ``RECORD_KEY``: a
  1-D int64 tensor ``[_MAGIC, _BUCKETS, c_0, ..., c_{B-1}]`` of checksums of every value of
  the dict. The checksum of an entry is $\sum_i h(k, p_i, b_i) \bmod 2^{64}$ over its
  elements, where $p_i$ is the element's position in the *global* tensor (row-major),
  $b_i$ its bit pattern and $k$ a hash of the key; $h$ mixes them (a 64-bit finaliser), so
  a changed, swapped or moved element changes the sum. Entry checksums are added into
  bucket $k \bmod B$. The sum is additive over elements, so each rank computes the part of
  its own shards and one ``all_reduce`` gives the whole; it does not depend on how the
  elements were split over the ranks, which is what lets a checkpoint saved on $N$ ranks
  be checked on $M$.
- [`state_from_dict`][functopt.distributed.state_from_dict] computes the same sums over
  the loaded values and compares them with the loaded record. With ``DTensor`` entries the
  comparison and every rank's structural checks travel in one ``all_reduce``, so every
  rank raises, or none does.

A ``DTensor`` element is counted by the ranks whose mesh coordinate is 0 on every
replicated mesh dimension (each element once); a plain tensor is counted by rank 0 alone
when the dict holds ``DTensor`` entries (DCP keeps one copy of a plain entry for all
ranks), and by each rank on its own otherwise; ``owned`` plain entries, which only one
rank holds (ZeRO-1's slices beside tensor parallelism on one data-parallel rank), by that
rank. A plain entry that rank 0 does not hold (with DTensor entries) is not covered. An
entry's checksum does not cover its dtype or shape: ``state_from_dict`` compares those
with the template. Whether the sums are collective follows from the dict (DTensor entries,
or ``owned`` ones), which is the same on every rank of one model; a plain-tensor dict needs
no collective, so one rank alone may call ``state_to_dict`` on a replicated state.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Set
from typing import Any

import torch
import torch.distributed as dist

from functopt._collective.dtensor import is_dtensor

RECORD_KEY = "@integrity"
_MAGIC = 0x46544F5054494E31  # "FTOPTIN1": the record's format
_BUCKETS = 64
_CHUNK = 1 << 16  # words hashed at a time: the int64 temporaries stay in cache
_MIX = (-7046029254386353131, -4658895280553007687, -7723592293110705685)  # 64-bit odd
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def key_hash(key: str) -> int:
    """A 63-bit hash of ``key``, the same in every process (``hash()`` is salted)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    return (z >> s) & ((1 << (64 - s)) - 1)  # a logical shift of the int64 bits


def _placement(local: torch.Tensor, value: Any) -> tuple[list[int], list[int], bool]:
    """The global offset and shape of the local block of ``value``, and whether it counts here."""
    if not is_dtensor(value):
        return [0] * local.dim(), list(local.shape), True
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = value.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the mesh: it holds nothing
        return [0] * local.dim(), list(value.shape), False
    counted = True
    for dim, p in enumerate(value.placements):
        if isinstance(p, Replicate):
            counted = counted and coordinate[dim] == 0
        elif not isinstance(p, (Shard, _StridedShard)):
            raise ValueError(
                f"a DTensor entry has the placement {p} on mesh dimension {dim}; a checkpoint "
                f"entry must be sharded or replicated. Fix: redistribute it before saving."
            )
    # DCP writes each local block at this offset (a _StridedShard's too, as FSDP2 over
    # tensor parallelism places it), so the sums key each element by DCP's own position.
    _, offset = compute_local_shape_and_global_offset(value.shape, mesh, value.placements)
    return list(offset), list(value.shape), counted


def _wrap(x: int) -> int:
    """``x`` as the int64 of its low 64 bits."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


_steps: dict[torch.device, torch.Tensor] = {}


def _step_terms(device: torch.device) -> torch.Tensor:
    """``arange(_CHUNK) * _MIX[0]`` on ``device`` (built once): the position terms of a chunk."""
    if device not in _steps:
        _steps[device] = torch.arange(_CHUNK, dtype=torch.int64, device=device).mul_(_MIX[0])
    return _steps[device]


def _hash_sum(z: torch.Tensor) -> torch.Tensor:
    """Sum over ``z`` (int64 bits plus position terms, changed in place) of the mixed value."""
    z.mul_(_MIX[1])
    z.bitwise_xor_(_shr(z, 32))
    return z.sum()


def entry_sum(key: str, value: torch.Tensor) -> torch.Tensor | None:
    """The checksum (0-d int64) of this rank's part of ``value``, or None if it counts nowhere here.

    Each element's word ``w`` (its bits as an integer; complex128 has two) at global word
    position ``q`` adds ``mix((w + (q + k) * _MIX[0]) * _MIX[1])``, ``k`` the key's hash.
    The local block is walked in runs that are contiguous in the global tensor (the whole
    block for a ``Shard(0)`` piece or a plain tensor), ``_CHUNK`` words at a time.
    """
    local = value.to_local() if is_dtensor(value) else value
    offset, shape, counted = _placement(local, value)
    if not counted or local.numel() == 0:
        return None
    size = local.element_size()
    words = _WORDS.get(size, torch.int64)  # complex128: two int64 words per element
    per = max(1, size // 8)
    bits = local.detach().contiguous().reshape(-1).view(words)
    device = bits.device
    gstride = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        gstride[d] = gstride[d + 1] * shape[d + 1]
    # the runs: dims after `lead` are whole in the local block, so each run is contiguous
    lead = max(0, local.dim() - 1)
    while lead > 0 and local.shape[lead] == shape[lead]:
        lead -= 1
    run = per * (1 if local.dim() == 0 else local.shape[lead:].numel())
    starts = torch.full((), sum(o * g for o, g in zip(offset, gstride, strict=True)),
                        dtype=torch.int64, device=device)
    for d in range(lead):  # the global position of each run's first element
        starts = (starts.unsqueeze(-1) + torch.arange(local.shape[d], device=device)
                  * gstride[d])
    starts = starts.reshape(-1) * per
    k = key_hash(key)
    steps = _step_terms(device)
    total = torch.zeros((), dtype=torch.int64, device=device)
    rows = bits.view(-1, run)
    if run >= _CHUNK // 8 or rows.shape[0] == 1:  # long runs: a chunk of one run at a time
        for r, start in enumerate(starts.tolist()):
            for s in range(0, run, _CHUNK):
                z = rows[r, s:s + _CHUNK].to(torch.int64, copy=True)  # (never the value)
                z.add_(steps[:z.numel()]).add_(_wrap((start + s + k) * _MIX[0]))
                total += _hash_sum(z)
        return total
    within = torch.arange(run, device=device)
    for r in range(0, rows.shape[0], _CHUNK // run):  # short runs: many rows at a time
        block = rows[r:r + _CHUNK // run]
        q = starts[r:r + block.shape[0]].unsqueeze(-1) + within
        total += _hash_sum(block.to(torch.int64, copy=True).add_(q.add_(k).mul_(_MIX[0])))
    return total


def _sharded(d: Mapping[str, Any]) -> bool:
    return dist.is_available() and dist.is_initialized() and any(
        is_dtensor(v) for v in d.values())


def _buckets(d: Mapping[str, Any], collective: bool,
             owned: Set[str]) -> tuple[torch.Tensor, torch.device]:
    """This rank's part of the bucket sums of ``d``'s entries (int64, ``(_BUCKETS,)``)."""
    plain_here = not collective or dist.get_rank() == 0
    sums, index = [], []
    device = _device(d)
    for key, value in d.items():
        if not is_dtensor(value) and not plain_here and key not in owned:
            continue
        s = entry_sum(key, value)
        if s is not None:
            sums.append(s)
            index.append(key_hash(key) % _BUCKETS)
    out = torch.zeros(_BUCKETS, dtype=torch.int64, device=device)
    if sums:
        out.index_add_(0, torch.tensor(index, device=device),
                       torch.stack([s.to(device) for s in sums]))
    return out, device


def make_record(d: Mapping[str, Any], owned: Set[str] = frozenset()) -> torch.Tensor:
    """The record of ``d``'s entries; with ``DTensor`` entries one ``all_reduce`` (default group).

    ``owned``: plain entries that this rank alone holds (counted here, not on rank 0 only).
    """
    collective = _sharded(d) or bool(owned)
    buckets, device = _buckets(d, collective, owned)
    if collective:
        dist.all_reduce(buckets)
    head = torch.tensor([_MAGIC, _BUCKETS], dtype=torch.int64, device=device)
    return torch.cat([head, buckets])


def check_record(owner: str, d: Mapping[str, Any], record: Any, *, collective: bool,
                 owned: Set[str], error: BaseException | None) -> None:
    """Raise, on every rank alike when ``collective``, if ``d`` does not match ``record``.

    ``error`` is this rank's own failure to rebuild the state (re-raised here, after the
    collective, so that the other ranks learn of it instead of waiting)."""
    well_formed = (isinstance(record, torch.Tensor) and not is_dtensor(record)
                   and record.dtype == torch.int64 and record.shape == (2 + _BUCKETS,)
                   and int(record[0]) == _MAGIC and int(record[1]) == _BUCKETS)
    bad = error is not None or not well_formed
    diff = torch.zeros(_BUCKETS, dtype=torch.int64, device=_device(d))
    if not bad:
        diff, _ = _buckets(d, collective, owned)
        if not collective or dist.get_rank() == 0:
            diff = diff - record[2:].to(diff.device)
    if collective:
        flags = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=diff.device)
        flags[dist.get_rank()] = 1 if bad else 0
        packed = torch.cat([flags, diff])
        dist.all_reduce(packed)
        flags, diff = packed[:flags.numel()], packed[flags.numel():]
        failed = [r for r, f in enumerate(flags.tolist()) if f]
    else:
        failed = [0] if bad else []
    if error is not None:
        raise error
    if not well_formed:
        raise ValueError(
            f"{owner}: the entry {RECORD_KEY!r} is {_describe(record)}, not the integrity "
            f"record state_to_dict writes (an int64 tensor of shape ({2 + _BUCKETS},) starting "
            f"with {_MAGIC:#x}). Fix: load into a dict made by state_to_dict, or drop the "
            f"entry from the dict of a checkpoint saved without the record."
        )
    if failed:
        raise ValueError(
            f"{owner}: the dict did not match the template on rank(s) {failed[:16]} (their "
            f"errors say how); every rank raises, so that none goes on with a state the "
            f"others do not have. Fix: see the error on those ranks."
        )
    wrong = {int(b) for b in torch.nonzero(diff).flatten().tolist()}
    if wrong:
        keys = sorted(k for k in d if key_hash(k) % _BUCKETS in wrong)
        counters = {k: int(v) for k, v in sorted(d.items())
                    if isinstance(v, torch.Tensor) and not is_dtensor(v) and v.dim() == 0
                    and not v.is_floating_point() and not v.is_complex()}
        raise ValueError(
            f"{owner}: the loaded values do not match the integrity record saved with them: "
            f"the checksums of {len(wrong)} of {_BUCKETS} groups of keys differ, which hold "
            f"the keys {keys[:16]}{f' and {len(keys) - 16} more' if len(keys) > 16 else ''} "
            f"(a changed one is among them); integer counters loaded: "
            f"{dict(list(counters.items())[:8])}. The checkpoint holds files of different "
            f"saves (a save that died while overwriting it), or was changed after saving, or "
            f"a plain (non-DTensor) entry differed between ranks when it was saved (DCP keeps "
            f"one rank's copy). Fix: load an intact checkpoint (save each step under a new "
            f"checkpoint_id and delete the previous one only after the save returned)."
        )


def _device(d: Mapping[str, Any]) -> torch.device:
    """Where the sums and the collective's tensor live: the first accelerator entry's device
    (a CPU counter beside them does not decide it), else the CPU."""
    for v in d.values():
        if isinstance(v, torch.Tensor):
            device = (v.to_local() if is_dtensor(v) else v).device
            if device.type != "cpu":
                return device
    return torch.device("cpu")


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        kind = "a DTensor" if is_dtensor(x) else "a tensor"
        return f"{kind} of dtype {x.dtype} and shape {tuple(x.shape)}"
    return f"a {type(x).__name__}"
