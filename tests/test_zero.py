"""ZeRO-1 (``functopt.distributed.zero.zero1``): single-process properties, then 2 and 4 gloo ranks.

The multi-rank checks live in ``tests/distributed/zero_checks.py`` (see its docstring for
the setting and the tolerances); one launch of the ranks per world size runs them all and
each check is one test here.
"""

from __future__ import annotations

import pytest
import torch
from distributed import harness, zero_checks
from hypothesis import given, settings
from hypothesis import strategies as st

import functopt
from functopt.distributed.zero import slice_bounds, zero1
from functopt.precision import mixed_precision
from functopt.testing import assert_bitwise_equal, clone_tree
from functopt.testing import strategies as fst

LAUNCH_TIMEOUT_S = 150.0


@given(st.integers(0, 40), st.integers(1, 6))
def test_slice_bounds_is_chunk(numel: int, world: int) -> None:
    """torch.chunk's split (DTensor's Shard(0), checked against DTensor in zero_checks),
    with an empty slice for each rank past the last chunk."""
    x = torch.arange(numel)
    parts = list(x.chunk(world)) if numel else []
    for rank in range(world):
        start, end = slice_bounds(numel, rank, world)
        expected = parts[rank] if rank < len(parts) else x[:0]
        assert torch.equal(x[start:end], expected)
        assert end - start <= -(-numel // world)  # no rank above one element over a share


@settings(max_examples=15)
@given(fst.params_and_gradients(grad_kind="any", allow_none=True))
def test_one_rank_is_mixed_precision_bitwise(pair) -> None:
    """Without a process group, zero1 is mixed_precision: same params and state, bitwise;
    pure (inputs untouched); every per-leaf state tensor is a 1-D slice (here: all of it)."""
    params, grads = pair
    kwargs = {"loss_scale": functopt.dynamic_loss_scale(init_scale=4.0), "max_grad_norm": 1.0}
    opt = zero1(functopt.adamw(1e-2, weight_decay=0.1), **kwargs)
    ref = mixed_precision(functopt.adamw(1e-2, weight_decay=0.1), **kwargs)
    state, ref_state = opt.init(params), ref.init(params)
    before = clone_tree((params, grads, state))
    new, state2 = opt.step(grads, state, params)
    ref_new, ref_state2 = ref.step(grads, ref_state, params)
    assert_bitwise_equal(new, ref_new, what="params")
    assert_bitwise_equal(clone_tree((params, grads, state)), before, what="inputs")
    flat = lambda t: functopt.tree._core.flatten(t)[0]  # noqa: E731
    for a, b in zip(flat(state2), flat(ref_state2), strict=True):
        if isinstance(b, torch.Tensor):
            # per-leaf state is the flattened leaf (a 0-d leaf's is 1-D); counters are 0-d
            assert a.dim() <= 1 and a.numel() == b.numel()
            assert_bitwise_equal(a, b.reshape(a.shape), what="state")


def test_process_group_must_be_a_group() -> None:
    with pytest.raises(TypeError, match=r"zero1: process_group must be a torch.distributed."
                                        r"ProcessGroup or None .*got str"):
        zero1(functopt.sgd(0.1), process_group="world")


def test_inner_errors_come_from_mixed_precision() -> None:
    with pytest.raises(TypeError, match=r"inner must be a functopt\.GradientTransformation"):
        zero1(functopt.adamw)


def test_grad_shape_error_names_the_leaf() -> None:
    opt = zero1(functopt.sgd(0.1))
    params = {"layer": {"w": torch.ones(2, 3)}}
    with pytest.raises(ValueError, match=r"'layer\.w': grad has shape \(3, 2\); expected the "
                                         r"param's shape \(2, 3\) .* or \(6,\) \(this rank's "
                                         r"slice, rank 0 of 1"):
        opt.step({"layer": {"w": torch.ones(3, 2)}}, opt.init(params), params)


def test_dtensor_params_are_rejected_without_a_group() -> None:
    # The DTensor check needs a mesh; it runs in zero_checks.zero1_errors. Here: a non
    # tensor leaf is named.
    with pytest.raises(TypeError, match=r"params leaf 'w' is a str"):
        zero1(functopt.sgd(0.1)).init({"w": "nope"})


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"{w}ranks")
def results(request: pytest.FixtureRequest) -> list[dict[str, str | None]]:
    return harness.run_ranks(zero_checks.run_all, request.param, timeout_s=LAUNCH_TIMEOUT_S)


@pytest.mark.parametrize("name", list(zero_checks.CHECKS))
def test_check(results: list[dict[str, str | None]], name: str) -> None:
    failures = [f"rank {rank}:\n{r[name]}" for rank, r in enumerate(results) if r[name]]
    assert not failures, "\n".join(failures)


@settings(max_examples=15)
@given(fst.params_and_gradients(grad_kind="any", allow_none=True), st.integers(1, 64))
def test_overlapped_one_rank_is_zero1_bitwise(pair, bucket_bytes: int) -> None:
    """Without a process group zero1_overlapped's params (through wait()) and state are
    zero1's, bitwise, whatever the bucket size; nothing is left in flight."""
    from functopt.distributed import zero1_overlapped
    params, grads = pair
    kwargs = {"loss_scale": functopt.dynamic_loss_scale(init_scale=4.0), "max_grad_norm": 1.0}
    opt = zero1_overlapped(functopt.adamw(1e-2), bucket_bytes=bucket_bytes, **kwargs)
    ref = zero1(functopt.adamw(1e-2), **kwargs)
    pending, state = opt.step(grads, opt.init(params), params)
    assert pending.arrived
    ref_params, ref_state = ref.step(grads, ref.init(params), params)
    assert_bitwise_equal(pending.wait(), ref_params, what="params")
    assert_bitwise_equal(state, ref_state, what="state")


@given(st.lists(st.one_of(st.none(), st.integers(0, 40)), max_size=12), st.integers(1, 4),
       st.integers(1, 48), st.sampled_from([torch.bfloat16, torch.float32]))
def test_buckets_partition_the_leaves_in_order(sizes, world: int, bucket_bytes: int,
                                               dtype: torch.dtype) -> None:
    """The buckets hold every non-None leaf once, in order; a bucket passes bucket_bytes
    (the longest rank's slices) only when it is a single leaf."""
    from functopt.distributed.overlap import _buckets
    leaves = [None if n is None else torch.zeros(n, dtype=dtype) for n in sizes]
    buckets = _buckets(leaves, leaves, world, bucket_bytes)
    assert [i for b in buckets for i in b] == [i for i, n in enumerate(sizes) if n is not None]
    for b in buckets:
        assert b
        used = sum(-(-leaves[i].numel() // world) * leaves[i].element_size() for i in b)
        assert used <= bucket_bytes or len(b) == 1, (b, used)


def test_overlapped_rejects_a_bad_bucket_size() -> None:
    from functopt.distributed import zero1_overlapped
    with pytest.raises(ValueError, match=r"bucket_bytes must be a positive int .* got 0"):
        zero1_overlapped(functopt.sgd(0.1), bucket_bytes=0)


def test_attach_names_a_leaf_that_is_no_module_parameter() -> None:
    from functopt.distributed import zero1_overlapped
    model = torch.nn.Linear(2, 1)
    params = {"weight": model.weight.detach(), "other": torch.ones(2)}
    opt = zero1_overlapped(functopt.sgd(0.1))
    pending, _ = opt.step({k: torch.ones_like(v) for k, v in params.items()},
                          opt.init(params), params)
    with pytest.raises(ValueError, match=r"params leaves \['other'\] are not parameters"):
        pending.attach(model)
    with pytest.raises(KeyError, match=r"no param at 'nope'"):
        pending.leaf("nope")


# Law: every collective of the step is bounded by zero1's timeout and its error names it.
# Rank 1 stops at a point of the step; rank 0 raises within the timeout (plus the step's own
# work), far below the harness group's 20 s, with zero1's note: (where rank 1 stops, the
# collective named, the note's words).
STOPPED_RANKS = [
    ("before the step", "all_reduce of the gradient statistics", "did not complete within"),
    ("before the all-gather", "all_gather of the new params", "did not complete within"),
    ("exits before the all-gather", "all_gather of the new params", None),
]


@pytest.mark.parametrize(("where", "collective", "words"), STOPPED_RANKS,
                         ids=[row[0] for row in STOPPED_RANKS])
def test_a_stopped_rank_raises_zero1s_error_within_the_timeout(
        where: str, collective: str, words: str | None) -> None:
    import functools
    (waited, message), _ = harness.run_ranks(
        functools.partial(zero_checks.stopped_rank_check, where=where), 2, timeout_s=60.0)
    assert waited < zero_checks.TIMEOUT_S + 3.0, (waited, message)
    if words is not None:  # a rank that hangs: the full timeout, then the timed-out note
        assert waited >= zero_checks.TIMEOUT_S, (waited, message)
    for part in (f"the {collective} of zero1's step (over 2 ranks: [0, 1])",
                 words or "", "Fix:", "restart every rank"):
        assert part in message, (part, message)
    if words is not None:
        assert f"timeout={zero_checks.TIMEOUT_S:g} s" in message, message
