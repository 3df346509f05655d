"""Params of every layout the compiled tier must handle, and their gradients: shared by
tests/test_compiled.py and tests/test_contrib_fast.py."""

from __future__ import annotations

import torch


def every_layout(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """Contiguous, channels_last, transposed, 0-d and empty leaves."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=dtype)

    return {"w": randn(4, 3), "b": randn(3),
            "conv": randn(2, 3, 2, 2).to(memory_format=torch.channels_last),
            "t": randn(3, 5).t(), "s": randn(), "e": torch.zeros(0, dtype=dtype)}


def grads_for(params: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Contiguous gradients, laid out unlike some params (the tier copies them into their
    params' layout)."""
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in params.items()}
