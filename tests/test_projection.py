"""centralize: each output unit's mean removed, against a float64 reference over mixed
dtypes, shapes (0-d, empty), non-finite values and None gradients."""

from __future__ import annotations

import math
from typing import Any

import torch
from hypothesis import given

import functopt
from functopt.testing import strategies as fst


def _leaves(tree: Any) -> list[Any]:
    return functopt.tree.flatten(tree)[0]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _reference(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The centralized ``g`` in float64, and the size of the terms (for the tolerance)."""
    g64 = g.double()
    n = max(math.prod(g.shape[1:]), 1)
    rows = g64.reshape(g.shape[0], math.prod(g.shape[1:]))
    # The mean as a sum of g / n: float64 itself would overflow on float64 inputs near max.
    means = torch.tensor([math.fsum((row / n).tolist()) if torch.isfinite(row).all()
                          else (row / n).sum().item() for row in rows], dtype=torch.float64)
    means = means.reshape((g.shape[0],) + (1,) * (g.dim() - 1))
    return g64 - means, g64.abs() + means.abs()


@given(fst.params_and_gradients(grad_kind="any", allow_none=True))
def test_centralize_matches_reference(pg) -> None:
    _, grads = pg
    tx = functopt.centralize()
    before = [None if g is None else g.clone() for g in _leaves(grads)]
    out, state = tx.update(grads, tx.init(None), None, unused_extra_arg=2)
    assert state == functopt.EmptyState() and fst.same_layout(out, grads)
    for old, g, o in zip(before, _leaves(grads), _leaves(out), strict=True):
        if g is None:
            assert o is None
            continue
        assert torch.equal(_bits(old), _bits(g))  # pure
        if g.dim() <= 1:
            assert o is g  # biases and scalars are returned as they are
            continue
        expected64, scale = _reference(g)
        expected = expected64.to(g.dtype)
        finite = torch.isfinite(expected) & torch.isfinite(scale)
        assert torch.equal(o[~finite].isnan(), expected[~finite].isnan())
        assert torch.equal(torch.nan_to_num(o[~finite]), torch.nan_to_num(expected[~finite]))
        info = torch.finfo(g.dtype)
        bound = 4 * info.eps * scale + info.smallest_normal
        assert ((o.double() - expected64).abs() <= bound)[finite].all()


def test_centralize_zeroes_each_output_units_mean() -> None:
    gen = torch.Generator().manual_seed(0)
    conv = torch.randn(4, 3, 2, 2, generator=gen, dtype=torch.float64)
    tx = functopt.centralize()
    out = tx.update({"conv": conv}, tx.init(None))[0]["conv"]
    torch.testing.assert_close(out.mean(dim=(1, 2, 3)), torch.zeros(4, dtype=torch.float64),
                               rtol=0, atol=1e-15)
    torch.testing.assert_close(out - conv, (out - conv)[:, :1, :1, :1].expand_as(conv))


def test_centralize_does_not_overflow_in_the_mean() -> None:
    # Two float32 values near the maximum: torch.mean's running sum would overflow to inf.
    big = torch.finfo(torch.float32).max * 0.75
    tx = functopt.centralize()
    g = torch.tensor([[big, big], [1.0, 3.0]])
    out = tx.update({"w": g}, tx.init(None))[0]["w"]
    assert torch.equal(out, torch.tensor([[0.0, 0.0], [-1.0, 1.0]]))


def test_centralize_keeps_low_precision_dtypes() -> None:
    tx = functopt.centralize()
    g = torch.tensor([[1.0, 2.0, 6.0]], dtype=torch.bfloat16)
    out = tx.update([g], tx.init(None))[0][0]
    assert out.dtype == torch.bfloat16 and out.tolist() == [[-2.0, -1.0, 3.0]]
