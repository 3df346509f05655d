"""The mixed-precision step's ``explain``: its path per group of leaves, and its memory
traffic against what a real step touches.

``MixedPrecisionTransformation.explain`` counts the step from its plan: the gradient casts,
the statistics pass, the planner's kernels on the masters and the writes of the params from
them. The count is held to a dispatch-mode count of the tensors a real CPU step reads and
writes (tests/touched.py), over bfloat16 params with float32 masters, a float32 param that
is its own master, loss scaling, clipping inside and outside the inner chain, the zero count
and both donation modes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from touched import Touched

import functopt
from functopt.precision import mixed_precision

SMALLEST = 64  # (the per-leaf norms and the packed statistics are a few bytes)


def _tree(with_float32: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    params = {"w": torch.randn(48, 32).bfloat16(), "v": torch.randn(32, 48).bfloat16()}
    if with_float32:
        params["b"] = torch.randn(64)
    grads = {k: (torch.randn(p.shape) * 10).to(p.dtype) for k, p in params.items()}
    return {"params": params, "grads": grads}


_STEPS = {
    "adamw": lambda donate: mixed_precision(functopt.adamw(1e-3, weight_decay=0.1),
                                            donate=donate),
    "adamw_scaled_clipped": lambda donate: mixed_precision(
        functopt.adamw(1e-3), loss_scale=functopt.dynamic_loss_scale(init_scale=2.0 ** 4),
        max_grad_norm=1.0, donate=donate),
    "inner_clip_sgd": lambda donate: mixed_precision(
        functopt.chain(functopt.clip_by_global_norm(1.0),
                       functopt.sgd(0.1, momentum=0.9)), donate=donate),
    "count_zeros": lambda donate: mixed_precision(functopt.adamw(1e-3), count_zeros=True,
                                                  donate=donate),
}


def _touched(step: Any, tree: dict[str, Any]) -> tuple[int, int, Any]:
    params = {k: p.clone() for k, p in tree["params"].items()}
    state = step.init(params)
    for _ in range(2):  # (buffers and plans are made in the first steps)
        params, state = step.step({k: g.clone() for k, g in tree["grads"].items()}, state,
                                  params)
    # (other gradients than the last step's: a cast into its buffer then changes it)
    grads = {k: g * 0.5 for k, g in tree["grads"].items()}
    explained = step.explain(params, state, grads)
    with Touched(SMALLEST) as touched:
        step.step(grads, state, params)
    return touched.read, touched.written, explained


@pytest.mark.parametrize("name", sorted(_STEPS))
@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("with_float32", [False, True], ids=["bf16", "bf16+f32"])
def test_mixed_step_traffic_is_what_the_step_touches(name: str, donate: bool,
                                                     with_float32: bool) -> None:
    tree = _tree(with_float32)
    read, written, explained = _touched(_STEPS[name](donate), tree)
    assert explained.fast, explained.reason
    assert (explained.bytes_read, explained.bytes_written) == (read, written)
    assert explained.elements == sum(p.numel() for p in tree["params"].values())


def test_the_donated_kernel_step_moves_44_bytes_per_bfloat16_param() -> None:
    # the cast (read 2, write 4), the statistics (read 4), the kernel (read master, cast and
    # two moments: 16; write master and moments: 12), the param from its master (read 4,
    # write 2)
    got = _STEPS["adamw"](True).explain(_tree(False)["params"])
    assert got.bytes_per_param == 44.0
    assert [g.kernel for g in got.groups] == ["torch._fused_adamw_"]
    undonated = _STEPS["adamw"](False).explain(_tree(False)["params"])
    assert undonated.bytes_per_param == 44.0 + 24.0  # masters and moments copied first


def test_a_step_off_the_fused_path_says_why_and_counts_nothing() -> None:
    step = mixed_precision(functopt.adamw(1e-3), fused=False)
    got = step.explain(_tree(False)["params"])
    assert not got.fast and got.reason == "fused=False"
    assert got.bytes_per_param is None and "not counted" in str(got)


def test_the_compiled_step_off_the_cpu_reads_the_bfloat16_gradients_itself(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # On the CPU the gradients are cast first (6 bytes per param) and the statistics read
    # the casts (4); the one call reads the casts (4), the master and two moments (12) and
    # writes master, moments (12) and the bf16 param (2): 40 bytes. Off the CPU the
    # statistics and the call read the bf16 gradients themselves (2 each): 30 bytes.
    from functopt.fast import _compiled

    step = mixed_precision(functopt.adamw(1e-3), compile=True, donate=True)
    params = step.lay_out({k: p.clone() for k, p in _tree(False)["params"].items()})
    got = step.explain(params, step.init(params))
    assert [g.kernel for g in got.groups] == ["compiled"]
    assert got.bytes_per_param == 40.0
    monkeypatch.setattr(_compiled, "READ_GIVEN_ON_CPU", True)  # (an accelerator's path)
    assert step.explain(params, step.init(params)).bytes_per_param == 30.0
    # a group of bf16 and float32 params is cast (one dtype per gathered buffer)
    mixed = step.lay_out({k: p.clone() for k, p in _tree(True)["params"].items()})
    assert step.explain(mixed, step.init(mixed)).bytes_per_param > 30.0


def test_a_multisteps_inner_transform_explains_its_closing_step_and_counts_nothing() -> None:
    inner = functopt.MultiSteps(functopt.adamw(1e-3), 2).gradient_transformation()
    got = mixed_precision(inner, donate=True).explain(_tree(False)["params"])
    assert got.fast and [g.kernel for g in got.groups] == ["torch._fused_adamw_"]
    assert got.mini_steps is not None and got.mini_steps.startswith("MultiSteps")
    assert got.bytes_per_param is None and "mini-steps are not counted" in str(got)
