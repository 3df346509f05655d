"""``explain``'s memory traffic against what a real step touches.

The count ``explain`` reports (from the plan for PyTorch's kernels, from a run on meta
tensors for the eager tiers) is held to a count of the tensors a real CPU step reads and
writes, taken here by a dispatch mode that sees every operation: a tensor is written when
its contents changed or it is a new result, read when an operation takes it (a copy's or
fill's destination and an ``out=`` argument excepted). Only tensors at least as large as
the smallest leaf are counted on both sides for the kernel tier (the per-leaf norms
stacked for a clip are a few bytes, which the plan leaves out).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from touched import Touched

import functopt
from functopt.fast import explain, make_step


def _tree(dtype: torch.dtype = torch.float32, transposed: bool = False,
          scale: float = 10.0) -> dict[str, Any]:
    torch.manual_seed(0)
    params = {"w": torch.randn(48, 32, dtype=dtype), "v": torch.randn(32, 48, dtype=dtype),
              "b": torch.randn(64, dtype=dtype)}
    grads = {k: torch.randn_like(p) * scale for k, p in params.items()}  # clipped at norm 1
    if transposed:
        grads["w"] = torch.randn(32, 48, dtype=dtype).t()
    return {"params": params, "grads": grads}


def _touched(tx: Any, tree: dict[str, Any], *, donate: bool, donate_grads: bool = False,
             smallest: int) -> tuple[int, int, Any]:
    params = {k: p.clone() for k, p in tree["params"].items()}
    step = make_step(tx, donate=donate, donate_grads=donate_grads)
    state = tx.init(params)
    for _ in range(2):  # (the plan and any scratch buffer are made in the first steps)
        grads = {k: g.clone() for k, g in tree["grads"].items()}
        params, state = step(grads, state, params)
    grads = {k: g.clone() for k, g in tree["grads"].items()}
    explained = explain(tx, params, state, grads, donate=donate, donate_grads=donate_grads)
    with Touched(smallest) as touched:
        step(grads, state, params)
    return touched.read, touched.written, explained


_KERNELS = {
    "adamw": lambda: functopt.adamw(1e-3, weight_decay=0.1),
    "clip_adamw": lambda: functopt.chain(functopt.clip_by_global_norm(1.0),
                                         functopt.adamw(1e-3)),
    "clip_amsgrad": lambda: functopt.chain(
        functopt.clip_by_global_norm(1.0), functopt.scale_by_amsgrad(correct_after_max=True),
        functopt.scale_by_learning_rate(1e-3)),
    "sgd_momentum": lambda: functopt.sgd(0.1, momentum=0.9),
    "sgd": lambda: functopt.sgd(0.1),
    "guarded_sgd": lambda: functopt.apply_if_finite(functopt.sgd(0.1, momentum=0.9), 3),
}


@pytest.mark.parametrize("name", sorted(_KERNELS))
@pytest.mark.parametrize("donate,donate_grads", [(False, False), (True, False), (True, True)])
def test_kernel_tier_traffic_is_what_the_step_touches(name: str, donate: bool,
                                                      donate_grads: bool) -> None:
    tree = _tree()
    read, written, explained = _touched(_KERNELS[name](), tree, donate=donate,
                                        donate_grads=donate_grads, smallest=64)
    assert explained.fast, explained.reason
    assert (explained.bytes_read, explained.bytes_written) == (read, written)
    assert explained.elements == sum(p.numel() for p in tree["params"].values())


def test_kernel_tier_traffic_counts_the_scaling_of_float64_gradients() -> None:
    # a float64 group multiplies its gradient copies by the clip's factor itself (the
    # kernels take the factor in float32): one more read of each gradient than twice a
    # float32 group's bytes (its clip's norm pass reads each gradient once, in float64)
    tx = _KERNELS["clip_adamw"]()
    read, written, wide = _touched(tx, _tree(torch.float64), donate=True, smallest=64)
    assert (wide.bytes_read, wide.bytes_written) == (read, written)
    narrow = explain(tx, _tree()["params"], donate=True)
    assert wide.bytes_read / wide.elements == 2 * narrow.bytes_read / narrow.elements + 8
    assert wide.bytes_written == 2 * narrow.bytes_written


def test_kernel_tier_traffic_counts_the_layout_copies_of_gradients() -> None:
    # gradients handed over are read as they are, except one laid out unlike its param
    tx = _KERNELS["clip_adamw"]()
    tree = _tree(transposed=True)
    read, written, explained = _touched(tx, tree, donate=True, donate_grads=True,
                                        smallest=64)
    assert (explained.bytes_read, explained.bytes_written) == (read, written)
    plain = explain(tx, _tree()["params"], donate=True, donate_grads=True)
    copied = tree["grads"]["w"].numel() * 4
    assert (explained.bytes_read, explained.bytes_written) == (
        plain.bytes_read + copied, plain.bytes_written + copied)


_EAGER = {
    "lion": lambda: functopt.lion(1e-4),
    "muon": lambda: functopt.contrib.muon(1e-3),
    "adafactor": lambda: functopt.adafactor(1e-3),
}


@pytest.mark.parametrize("name", sorted(_EAGER))
@pytest.mark.parametrize("donate", [False, True])
def test_eager_tier_traffic_is_what_the_step_touches(name: str, donate: bool) -> None:
    import warnings

    # (Adafactor adds 1e-30 to the squared gradients in place: small gradients, so that
    # the write shows in the contents)
    tree = _tree(scale=1e-15 if name == "adafactor" else 10.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", functopt.fast.FastPathWarning)
        read, written, explained = _touched(_EAGER[name](), tree, donate=donate, smallest=1)
    assert explained.traffic_reason is None
    assert (explained.bytes_read, explained.bytes_written) == (read, written)


def test_eager_traffic_is_counted_as_on_an_accelerator() -> None:
    # clip_by_global_norm measures overflowed float32 norms again in float64: on the CPU
    # only when one overflowed (a host read), elsewhere always; the count is the latter's
    import warnings

    tx = functopt.chain(functopt.clip_by_global_norm(1.0), functopt.lion(1e-4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", functopt.fast.FastPathWarning)
        read, written, explained = _touched(tx, _tree(), donate=True, smallest=1)
    leaves = _tree()["grads"].values()
    grads = sum(g.numel() * 4 for g in leaves)
    # (and the few bytes of the stacked per-leaf norms of that second measure)
    assert grads <= explained.bytes_read - read <= grads + 32 * len(leaves)
    assert 0 <= explained.bytes_written - written <= 32 * len(leaves)


def test_traffic_per_param_of_the_readme_chain() -> None:
    # the clip chain donated: a norm pass (4), the gradient copies (8), the kernel reading
    # param, gradient and two moments (16) and writing them (16): 44 bytes per param
    tree = _tree()
    tx = _KERNELS["clip_adamw"]()
    got = explain(tx, tree["params"], donate=True)
    assert got.bytes_per_param == 44.0
    assert explain(tx, tree["params"], donate=True, donate_grads=True).bytes_per_param == 36.0
    assert "44.0 bytes per param per step" in str(got)


def test_traffic_not_counted_says_why() -> None:
    class Reads(functopt.GradientTransformation):
        pass

    def update(updates: Any, state: Any, params: Any = None) -> Any:
        scale = float(sum(u.abs().sum() for u in updates.values()).item())  # a host read
        return {k: u / scale for k, u in updates.items()}, state

    tx = functopt.GradientTransformation(lambda p: (), update)
    got = explain(tx, _tree()["params"])
    assert got.bytes_per_param is None
    assert got.traffic_reason and "not counted" in str(got)
