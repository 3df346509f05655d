"""What the fast paths warn and raise: a step that lost its fast path, a step that cannot
be recorded for replay."""

from __future__ import annotations

import warnings

__all__ = ["CaptureError", "FastPathWarning", "warn_lost"]


class FastPathWarning(UserWarning):
    """A step that was asked to be fast runs on the pure path (correct, slower); the message
    names the transform or leaf and the reason. ``functopt.fast.explain`` tells the same
    before training starts.

    Examples:
        >>> import warnings, torch, functopt
        >>> step = functopt.fast.make_step(functopt.lion(1e-4))
        >>> params = {"w": torch.zeros(2)}
        >>> state = functopt.lion(1e-4).init(params)
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     _ = step({"w": torch.ones(2)}, state, params)
        >>> caught[0].category.__name__, "scale_by_lion has no fused kernel" in str(caught[0].message)
        ('FastPathWarning', True)
    """


class CaptureError(RuntimeError):
    """A step cannot be recorded for replay ([`Step.capture`][functopt.fast.Step.capture]):
    it reads a value back to the host while it runs (a CUDA graph replays the device's work
    only, so such a value would stay what it was when recorded), or its state would leave
    the tensors it was recorded on. The message names the value and the fix.

    Examples:
        >>> import functopt
        >>> issubclass(functopt.fast.CaptureError, RuntimeError)
        True
    """


def warn_lost(owner: str, reason: str, stacklevel: int) -> None:
    """Warn that this step lost its fast path (Python shows each message once per place)."""
    warnings.warn(
        f"{owner}: the fast path is lost, this step runs on the pure per-leaf path (correct, "
        f"several times slower): {reason}. See functopt.fast.explain(tx, params).",
        FastPathWarning, stacklevel=stacklevel + 1)
