"""Loading saved states with ``torch.load(..., weights_only=True)``, PyTorch's default.

A functopt state is a pytree of tensors inside NamedTuples (``ScaleByAdamState``,
``EmptyState``, ...). ``torch.save`` writes them as they are, and the default
``torch.load`` (``weights_only=True`` since PyTorch 2.6) refuses any class it has not been
told is safe. [`state_classes`][functopt.state_classes] lists functopt's NamedTuple
classes (plain data: fields of tensors, numbers and trees, no code runs when they are
built). ``import functopt`` allows them in every ``torch.load`` of the process
(``torch.serialization.add_safe_globals``): the package's one global side effect, made on
purpose so that a state saved with ``torch.save`` loads with PyTorch's default as a tensor
does, without turning ``weights_only`` off (which would let a checkpoint run arbitrary
code). Classes of a user's own rules are not allowed by it;
[`safe_globals`][functopt.safe_globals] allows functopt's for one block (after
``torch.serialization.clear_safe_globals()``, say).

[`save_checkpoint`][functopt.save_checkpoint] writes a file atomically (a process killed
while saving leaves the previous file whole) and
[`load_checkpoint`][functopt.load_checkpoint] reads it back with the safe loader, turning
a truncated or damaged file into an error that names it and says what to do.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import tempfile
import zipfile
from collections.abc import Callable
from typing import Any

import torch

# Imported for their state classes: everything the package defines is loaded before the
# module table is read.
import functopt.adapters
import functopt.contrib
import functopt.distributed
import functopt.precision  # noqa: F401
from functopt import _validate

__all__ = ["load_checkpoint", "safe_globals", "save_checkpoint", "state_classes"]


def _is_namedtuple_class(obj: Any) -> bool:
    return (isinstance(obj, type) and issubclass(obj, tuple)
            and isinstance(getattr(obj, "_fields", None), tuple))


def state_classes() -> list[type]:
    """Every NamedTuple class functopt defines (the states and what they hold), by name.

    ``import functopt`` passes them to ``torch.serialization.add_safe_globals``, which
    allows them in every later ``torch.load`` of the process;
    [`safe_globals`][functopt.safe_globals] allows them for one block.

    Examples:
        >>> import functopt
        >>> names = [cls.__name__ for cls in functopt.state_classes()]
        >>> "ScaleByAdamState" in names and "EmptyState" in names and "MixedPrecisionState" in names
        True
    """
    found: dict[str, type] = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "functopt" or name.startswith("functopt.")):
            continue
        for obj in vars(module).values():
            if _is_namedtuple_class(obj) and obj.__module__.startswith("functopt"):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return [found[key] for key in sorted(found)]


def safe_globals() -> Any:
    """A context manager in which ``torch.load`` (``weights_only=True``) accepts functopt states.

    ``torch.serialization.safe_globals(functopt.state_classes())``: inside the block the
    default, safe ``torch.load`` reads a state saved with ``torch.save``. ``import
    functopt`` already allows these classes for the whole process; the block is for code
    that cleared PyTorch's allowed globals (``torch.serialization.clear_safe_globals()``).
    The state classes hold only data, so this keeps the guarantee of ``weights_only`` that
    loading a file runs no code from it.

    Examples:
        >>> import io, torch, functopt
        >>> params = {"w": torch.zeros(2)}
        >>> state = functopt.adamw(1e-3).init(params)
        >>> buffer = io.BytesIO()
        >>> torch.save(state, buffer)
        >>> _ = buffer.seek(0)
        >>> with functopt.safe_globals():
        ...     loaded = torch.load(buffer)  # weights_only=True, PyTorch's default
        >>> type(loaded[0]).__name__, bool(loaded[0].mu["w"].eq(0).all())
        ('ScaleByAdamState', True)
    """
    return allowing(state_classes())


def allowing(classes: list[type]) -> Any:
    """A context manager that allows those of ``classes`` not allowed yet, for the block.

    ``torch.serialization.safe_globals`` removes its globals on leaving the block, also
    those that were allowed before it (as ``import functopt`` allows the state classes), so
    it is given only the missing ones.
    """
    before = set(torch.serialization.get_safe_globals())
    missing: list[Callable[..., Any] | tuple[Callable[..., Any], str]] = [
        cls for cls in classes if cls not in before]
    return torch.serialization.safe_globals(missing)


def allow_state_classes() -> None:
    """Allow functopt's state classes in every later ``torch.load`` (called at import)."""
    allowed: list[Callable[..., Any] | tuple[Callable[..., Any], str]] = list(state_classes())
    torch.serialization.add_safe_globals(allowed)


CHECKPOINT_UNREADABLE = (
    "load_checkpoint: {path!r} ({size}) is not a readable checkpoint: {cause}. The file is "
    "truncated or damaged: a save that did not finish (a process killed while writing "
    "with a plain torch.save to this path), a partial copy, or a full disk. Fix: load the "
    "previous checkpoint; save with functopt.save_checkpoint, which writes a temporary "
    "file and renames it into place, so a killed save leaves the previous file whole."
)

CHECKPOINT_UNSAFE = (
    "load_checkpoint: {path!r} holds an object that the safe loader (weights_only=True) "
    "does not allow: {cause}. functopt's state classes are allowed; anything else must be "
    "allowed by you. Fix: torch.serialization.add_safe_globals([TheClass]) for a class you "
    "trust, or save plain tensors, dicts and functopt states only."
)


def _size(path: str) -> str:
    try:
        return f"{os.path.getsize(path)} bytes"
    except OSError:
        return "size unknown"


def save_checkpoint(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj, path)``, atomically: the file at ``path`` is the old one or the new one.

    The object is written to a temporary file in the same directory, flushed to disk
    (``fsync``), and renamed over ``path`` (``os.replace``, atomic on POSIX and Windows);
    the directory is then synced so that the rename survives a power cut. A process killed
    at any point leaves ``path`` as it was (at worst a stray ``.<name>.*.tmp`` file beside
    it, which a later save does not read). A plain ``torch.save(obj, path)`` killed half way
    leaves a truncated file in place of the previous checkpoint.

    For sharded checkpoints (``torch.distributed.checkpoint``), save each checkpoint to a
    new directory: DCP writes its ``.metadata`` file last, so a directory without it is an
    unfinished save, and the previous directory stays whole.

    Args:
        obj: what ``torch.save`` accepts: a state, a state dict, a dict of them.
        path: the file to write.

    Raises:
        OSError: the directory cannot be written (nothing is left behind).

    Examples:
        >>> import os, tempfile, torch, functopt
        >>> state = functopt.adamw(1e-3).init({"w": torch.zeros(2)})
        >>> with tempfile.TemporaryDirectory() as d:
        ...     path = os.path.join(d, "opt.pt")
        ...     functopt.save_checkpoint(state, path)
        ...     loaded = functopt.load_checkpoint(path)
        ...     os.listdir(d)
        ['opt.pt']
        >>> type(loaded[0]).__name__
        'ScaleByAdamState'
    """
    target = os.path.abspath(os.fspath(path))
    directory, name = os.path.split(target)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # what open() would have given, not mkstemp's 0o600
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # not every platform can open a directory
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def load_checkpoint(path: str | os.PathLike[str], *, map_location: Any = None,
                    verify: bool = True) -> Any:
    """``torch.load(path, weights_only=True)`` inside [`safe_globals`][functopt.safe_globals], with clear errors.

    ``torch.save`` writes a zip archive with a CRC-32 per record, which ``torch.load`` does
    not check: a flipped byte inside a tensor's data loads silently as a wrong value. With
    ``verify=True`` every record's CRC-32 is checked first (one extra read of the file).

    Args:
        path: a file written by [`save_checkpoint`][functopt.save_checkpoint] (or
            ``torch.save``).
        map_location: as for ``torch.load`` (``"cpu"`` to load a GPU checkpoint on a host).
        verify: check every record's CRC-32 before loading (``False`` skips the extra read).

    Returns:
        The saved object; functopt states come back as their NamedTuple classes.

    Raises:
        FileNotFoundError: there is no file at ``path``.
        ValueError: the file is truncated or damaged (``CHECKPOINT_UNREADABLE``, naming the
            file, its size and the reason: PyTorch's, or the record whose CRC-32 is wrong), or holds a class the safe loader does not
            allow (``CHECKPOINT_UNSAFE``).

    Examples:
        >>> import os, tempfile, functopt
        >>> with tempfile.TemporaryDirectory() as d:
        ...     path = os.path.join(d, "opt.pt")
        ...     with open(path, "wb") as f:
        ...         _ = f.write(b"PK\x03\x04 not a whole file")
        ...     try:
        ...         functopt.load_checkpoint(path)
        ...     except ValueError as error:
        ...         print(str(error).split(":")[0], "truncated or damaged" in str(error))
        load_checkpoint True
    """
    target = os.fspath(path)
    if not os.path.exists(target):
        raise FileNotFoundError(
            f"load_checkpoint: no file at {target!r}. Fix: pass the path save_checkpoint "
            f"wrote (a stray '.<name>.*.tmp' beside it is an unfinished save, not a checkpoint)."
        )
    _validate.check_flags("load_checkpoint", verify=verify)
    if verify:
        _verify(target)
    try:
        with safe_globals():
            return torch.load(target, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        if "weights only" in str(exc).lower() and "unsupported global" in str(exc).lower():
            cause = str(exc).strip().splitlines()[-1] if str(exc).strip() else repr(exc)
            raise ValueError(CHECKPOINT_UNSAFE.format(path=target, cause=cause)) from exc
        raise ValueError(CHECKPOINT_UNREADABLE.format(
            path=target, size=_size(target), cause=_first_line(exc))) from exc
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, KeyError,
            IndexError, UnicodeDecodeError, OverflowError, MemoryError, OSError) as exc:
        if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError)):
            raise
        raise ValueError(CHECKPOINT_UNREADABLE.format(
            path=target, size=_size(target), cause=_first_line(exc))) from exc


def _verify(path: str) -> None:
    """Raise ``CHECKPOINT_UNREADABLE`` if a record's CRC-32 does not match its data."""
    if not zipfile.is_zipfile(path):
        return  # truncated past the zip directory, or the legacy format: torch.load decides
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except Exception as exc:
        raise ValueError(CHECKPOINT_UNREADABLE.format(
            path=path, size=_size(path), cause=_first_line(exc))) from exc
    if bad is not None:
        raise ValueError(CHECKPOINT_UNREADABLE.format(
            path=path, size=_size(path),
            cause=f"the CRC-32 of the record {bad!r} does not match its data"))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")
