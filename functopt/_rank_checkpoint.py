"""Checkpoints of per-rank objects that a save killed part way cannot tear.

Megatron-style tensor and pipeline parallelism keeps plain tensors: each rank holds its own
slices and stage, under names another rank also uses, so its state cannot go through
``torch.distributed.checkpoint`` (which takes a plain tensor for a replica) and each rank
saves its own file. A rank killed while the others write would leave a directory of files
from two steps. [`save_rank_checkpoint`][functopt.save_rank_checkpoint] writes
each checkpoint into a new directory, every rank's file atomically, and marks the
directory complete only after every rank has written;
[`load_rank_checkpoint`][functopt.load_rank_checkpoint] loads the newest
complete one, the same step on every rank, and raises on every rank when the files do not
belong together.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from functopt._serialization import load_checkpoint, save_checkpoint

__all__ = ["load_rank_checkpoint", "save_rank_checkpoint"]

_RECORD = "COMPLETE.json"
_STEP = re.compile(r"^step-(\d{9})$")


def _world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _file(folder: Path, rank: int, world: int) -> Path:
    return folder / f"rank-{rank:05d}-of-{world:05d}.pt"


def _all_ok(ok: bool, group: dist.ProcessGroup | None) -> bool:
    """Whether ``ok`` holds on every rank (one all-reduce; True alone without a group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return ok
    flag = torch.tensor([0.0 if ok else 1.0], dtype=torch.float64)
    dist.all_reduce(flag, group=group)
    return float(flag) == 0.0


def save_rank_checkpoint(obj: Any, directory: str | os.PathLike[str], step: int, *,
                         group: dist.ProcessGroup | None = None, keep: int = 2) -> Path:
    """Save this rank's ``obj`` as its part of the checkpoint of ``step``; collective.

    Every rank of ``group`` (default: all) writes ``directory/step-<step>/rank-<r>-of-<N>.pt``
    with [`save_checkpoint`][functopt.save_checkpoint] (atomically); once every rank's
    write succeeded (one all-reduce), rank 0 writes the directory's completion record
    (``COMPLETE.json``: the step and the number of ranks), atomically too, and then
    removes the oldest complete checkpoints past ``keep``. A save killed on any rank
    before the record leaves no record, so the previous checkpoint stays the newest
    complete one; a failed write on one rank raises on every rank.

    Args:
        obj: what ``torch.save`` takes: this rank's state dicts (its model's and its
            optimizer's).
        directory: the folder of the checkpoints (shared by the ranks).
        step: the step the checkpoint is of, an int >= 0.
        group: the ranks that save together (default: the default group; without
            ``torch.distributed``, one rank).
        keep: how many complete checkpoints to keep, >= 1.

    Returns:
        The folder of this checkpoint.

    Raises:
        ValueError: a bad ``step`` or ``keep``.
        RuntimeError: a rank's write failed (on every rank).

    Examples:
        >>> import tempfile, torch, functopt
        >>> from functopt import load_rank_checkpoint, save_rank_checkpoint
        >>> with tempfile.TemporaryDirectory() as d:
        ...     _ = save_rank_checkpoint({"w": torch.ones(2)}, d, 3)
        ...     _ = save_rank_checkpoint({"w": torch.zeros(2)}, d, 6)
        ...     load_rank_checkpoint(d)
        (6, {'w': tensor([0., 0.])})
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"save_rank_checkpoint: step must be an int >= 0, got {step!r}.")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"save_rank_checkpoint: keep must be an int >= 1, got {keep!r}.")
    rank, world = _world(group)
    folder = Path(directory) / f"step-{step:09d}"
    error = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        save_checkpoint(obj, _file(folder, rank, world))
    except OSError as e:
        error = e
    if not _all_ok(error is None, group):
        raise RuntimeError(
            f"save_rank_checkpoint: the checkpoint of step {step} in {folder} was not "
            f"written by every rank (this rank: {error or 'written'}); it is left "
            f"incomplete and the previous one stays the newest. Fix: see the failing "
            f"rank's error.") from error
    if rank == 0:
        record = json.dumps({"step": step, "world": world}).encode()
        fd, tmp = tempfile.mkstemp(prefix=f".{_RECORD}.", suffix=".tmp", dir=folder)
        with os.fdopen(fd, "wb") as f:
            f.write(record)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, folder / _RECORD)
        for old in _complete(Path(directory))[:-keep]:
            shutil.rmtree(old[1], ignore_errors=True)
    _all_ok(True, group)  # (the record is written before any rank goes on)
    return folder


def _complete(directory: Path) -> list[tuple[int, Path]]:
    """The complete checkpoints of ``directory``, oldest first."""
    found = []
    if directory.is_dir():
        for entry in directory.iterdir():
            match = _STEP.match(entry.name)
            if match and (entry / _RECORD).is_file():
                found.append((int(match.group(1)), entry))
    return sorted(found)


def load_rank_checkpoint(directory: str | os.PathLike[str], *,
                         group: dist.ProcessGroup | None = None,
                         map_location: Any = None) -> tuple[int, Any]:
    """This rank's part of the newest complete checkpoint: ``(step, obj)``; collective.

    Rank 0 picks the newest folder with a completion record, and every rank loads its
    own file of it ([`load_checkpoint`][functopt.load_checkpoint], CRC-checked); folders
    of saves that did not complete are passed over.

    Raises:
        FileNotFoundError: there is no complete checkpoint (on every rank).
        ValueError: the checkpoint was saved by another number of ranks, or this rank's
            file is missing or damaged (on every rank, naming the ranks' errors).

    Examples:
        >>> import tempfile, torch
        >>> from functopt import load_rank_checkpoint, save_rank_checkpoint
        >>> with tempfile.TemporaryDirectory() as d:
        ...     _ = save_rank_checkpoint({"w": torch.ones(2)}, d, 3)
        ...     load_rank_checkpoint(d)
        (3, {'w': tensor([1., 1.])})
    """
    rank, world = _world(group)
    directory = Path(directory)
    newest = _complete(directory)
    choice = [newest[-1][0] if newest else -1]
    if world > 1:
        dist.broadcast_object_list(choice, src=dist.get_global_rank(group, 0)
                                   if group is not None else 0, group=group)
    step = int(choice[0])
    if step < 0:
        raise FileNotFoundError(
            f"load_rank_checkpoint: no complete checkpoint in {directory} (no step-* folder "
            f"with a {_RECORD}). Fix: save one with save_rank_checkpoint, or start afresh.")
    folder = directory / f"step-{step:09d}"
    error: Exception | None = None
    obj = None
    try:
        saved = json.loads((folder / _RECORD).read_text())
        if saved.get("world") != world:
            raise ValueError(f"the checkpoint of step {step} was saved by {saved.get('world')} "
                             f"ranks, this group has {world}")
        obj = load_checkpoint(_file(folder, rank, world), map_location=map_location)
    except (OSError, ValueError) as e:
        error = e
    if not _all_ok(error is None, group):
        raise ValueError(
            f"load_rank_checkpoint: the checkpoint of step {step} in {folder} cannot be "
            f"loaded on every rank (this rank: {error or 'loaded'}). Fix: load it with "
            f"the number of ranks that saved it, or restore its files.") from error
    return step, obj
