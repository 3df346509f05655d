"""functopt.distributed on plain tensors, in one process (no process group needed).

The multi-rank behaviour (DTensor shards, replicated leaves, one collective, FSDP2) is in
``tests/test_distributed_fsdp.py``, the local statistics against their definition in
``tests/test_collective_stats.py``; here: plain tensors make no collective, and the errors
that need no process group.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor.debug import CommDebugMode

import functopt
from functopt import distributed as fdist
from functopt.testing import assert_bitwise_equal
from functopt.testing import strategies as fst
from functopt.tree import _core


@given(fst.params_and_gradients(grad_kind="any", allow_none=True))
def test_global_grad_stats_without_dtensors_makes_no_collective(pair) -> None:
    _, grads = pair
    with CommDebugMode() as comm:
        packed = fdist.global_grad_stats(grads)
    assert comm.get_total_counts() == 0
    assert_bitwise_equal(packed, fdist.local_grad_stats(grads))


def test_all_reduce_stats_without_group_is_identity() -> None:
    packed = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    assert fdist.all_reduce_stats(packed, None) is packed


def test_empty_and_none_trees() -> None:
    zeros = torch.zeros(3, dtype=torch.float64)
    assert torch.equal(fdist.local_grad_stats({"a": None, "b": []}), zeros)
    assert fdist.local_grad_stats([], device=torch.device("meta")).device.type == "meta"
    assert torch.equal(fdist.local_grad_stats([torch.empty(0, 3)]), zeros)


def test_plain_tensors_helpers() -> None:
    x = torch.ones(2)
    assert not fdist.is_dtensor(x)
    assert fdist.local_tensor(x) is x
    assert fdist.counted_here(x)
    assert fdist.infer_group([x, None], names=["x", "y"]) is None


def test_non_tensor_leaf_is_named() -> None:
    with pytest.raises(TypeError, match=r"grads leaf 'layer\.w' is a str; expected a tensor"):
        fdist.local_grad_stats({"layer": {"w": "oops"}})


def test_mixed_precision_on_plain_tensors_makes_no_collective() -> None:
    opt = functopt.precision.mixed_precision(functopt.adamw(1e-2), max_grad_norm=1.0)
    params = {"w": torch.ones(3, dtype=torch.bfloat16), "b": torch.zeros(2)}
    grads = {"w": torch.full((3,), 0.5, dtype=torch.bfloat16), "b": torch.ones(2)}
    state = opt.init(params)
    with CommDebugMode() as comm:
        new, state = opt.step(grads, state, params)
    assert comm.get_total_counts() == 0
    assert not bool(state.metrics.found_inf) and not torch.equal(new["b"], params["b"])


def test_mixed_precision_rejects_a_non_group() -> None:
    with pytest.raises(TypeError, match=r"process_group must be a torch.distributed.ProcessGroup "
                                        r"or None .*got str"):
        functopt.precision.mixed_precision(functopt.sgd(0.1), process_group="world")


@given(fst.params_and_gradients(grad_kind="any", allow_none=True), st.booleans())
def test_declarations_without_a_group_change_nothing(pair, flag: bool) -> None:
    """No group and no DTensor: nothing is summed, so every plain leaf counts here whatever
    ``replicated`` declares (one bool, or a per-leaf tree)."""
    _, grads = pair
    leaves, spec = _core.flatten(grads)
    per_leaf = _core.unflatten(spec, [flag] * len(leaves))
    for replicated in (flag, per_leaf, lambda tree: per_leaf):
        with CommDebugMode() as comm:
            packed = fdist.global_grad_stats(grads, replicated=replicated)
        assert comm.get_total_counts() == 0
        assert_bitwise_equal(packed, fdist.local_grad_stats(grads))


def test_replicated_errors_name_the_entry() -> None:
    grads = {"dense": {"w": torch.ones(2)}, "expert": torch.ones(3)}
    with pytest.raises(TypeError, match=r"global_grad_stats: replicated entry 'expert' is a str; "
                                        r"expected True, False or a torch.distributed."
                                        r"ProcessGroup\. Fix: pass replicated=True if"):
        fdist.global_grad_stats(grads, replicated={"dense": True, "expert": "yes"})
    with pytest.raises(ValueError, match=r"global_grad_stats: replicated must have the structure "
                                         r"of the grads, or of a prefix of it"):
        fdist.global_grad_stats(grads, replicated={"dense": True})
    with pytest.raises(TypeError, match=r"mixed_precision: replicated entry 'w' is a int"):
        opt = functopt.precision.mixed_precision(functopt.sgd(0.1), replicated={"w": 1})
        opt.step({"w": torch.ones(2)}, opt.init({"w": torch.ones(2)}), {"w": torch.ones(2)})
