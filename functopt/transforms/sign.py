"""Sign-based rescaling: ``scale_by_sign`` (signSGD)."""

from __future__ import annotations

from typing import Any

import torch

from functopt._base import EmptyState, GradientTransformation, Params, Updates
from functopt.transforms import _common

__all__ = [
    "scale_by_sign",
]


def _sign(x: torch.Tensor) -> torch.Tensor:
    """Elementwise sign with XLA's (so jax's, so optax's) conventions (private helper).

    ``torch.sign`` maps NaN to 0 and -0.0 to +0.0; this keeps NaN and signed zeros as they
    are, so that a NaN gradient is not silently turned into a zero update.
    """
    return torch.where((x > 0) | (x < 0), torch.sign(x), x)


def scale_by_sign() -> GradientTransformation:
    r"""Replace each update by its elementwise sign: $u \leftarrow \operatorname{sign}(u)$.

    $\operatorname{sign}$ is 1 or -1, and ±0 and NaN are kept as they are (as
    ``jnp.sign`` does; ``torch.sign`` would turn NaN into 0 and hide it). The update keeps
    its dtype; ``None`` updates stay ``None``. signSGD is ``chain(scale_by_sign(),
    scale(-lr))``.

    Returns:
        A stateless [`GradientTransformation`][functopt.GradientTransformation].

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.scale_by_sign()
        >>> tx.update({"w": torch.tensor([0.2, -7.0, 0.0])}, tx.init(None))[0]
        {'w': tensor([ 1., -1.,  0.])}

    References:
        Bernstein et al., *signSGD: Compressed Optimisation for Non-Convex Problems*,
        ICML 2018.
    """

    def init_fn(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update_fn(
        updates: Updates, state: EmptyState, params: Params | None = None, **extra_args: Any
    ) -> tuple[Updates, EmptyState]:
        _common.check_state("scale_by_sign", state, EmptyState)
        del params, extra_args
        leaves, treespec = _common.flatten_updates(updates)
        return _common.unflatten(treespec, [None if u is None else _sign(u)
                                            for u in leaves]), state

    return GradientTransformation(init_fn, update_fn)
