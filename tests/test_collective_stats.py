"""The one local statistics pass (functopt/_collective/stats.py) against the definitions.

Over hypothesis-drawn leaves (0-d, empty, non-contiguous, every float dtype, inf and nan,
some not counted by this rank), each form of the pass is held bitwise to the pure
definition of its statistic: a leaf's squared norm is ``tree._ops._sum_of_squares`` (its
rescue ``_safe_norm``), a non-finite flag is ``not isfinite(x).all()``, the packed
``[sum of squares, non-finite count, zero count]`` is `local_stats` (rows of
``_leaf_stats`` summed over the leaves), and the public ``grad_stats`` and
``local_grad_stats`` are views of it.
"""

from __future__ import annotations

import math

import torch
from hypothesis import example, given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from functopt import distributed as fdist
from functopt._collective import stats
from functopt.precision import grad_stats
from functopt.testing import assert_bitwise_equal, clone_tree
from functopt.testing import strategies as fst
from functopt.tree import _core, _ops

_CPU = torch.device("cpu")


@st.composite
def _leaves(draw: st.DrawFn) -> tuple[list[torch.Tensor | None], list[bool]]:
    """Flat leaves (None among them) and, per leaf, whether this rank counts it."""
    tree = draw(fst.params(kind="any", layout="any", allow_none=True, max_leaves=7))
    leaves = _core.flatten(tree)[0]
    counted = [x is not None and draw(st.booleans()) for x in leaves]
    return leaves, counted


def _acc(x: torch.Tensor, accumulate: torch.dtype | None = None) -> torch.dtype:
    return accumulate or (torch.float64 if x.dtype == torch.float64 else torch.float32)


def _square(x: torch.Tensor, multiplier: torch.Tensor | None = None, *, rescue: bool = False,
            accumulate: torch.dtype | None = None) -> torch.Tensor:
    """The definition of a leaf's squared norm in the pass."""
    if multiplier is None:
        out = _ops._sum_of_squares(x, _acc(x, accumulate))
    else:
        norm = torch.linalg.vector_norm(x, dtype=_acc(x, accumulate))
        out = (norm * multiplier.to(norm.dtype)).to(torch.float64) ** 2
    if rescue and bool(torch.isinf(out)):
        wide = _ops._safe_norm(x)
        if bool(torch.isfinite(wide)):
            out = wide ** 2
    return out


@given(_leaves(), st.sampled_from([None, 1.0, 2.0 ** -14, 0.3, 3e38]),
       st.sampled_from([None, torch.float64, "rescue"]))
@example(([torch.full((2,), 3e38), torch.full((3,), 3e38).bfloat16()], [True, True]), None,
         "rescue")
def test_square_groups_are_the_definition(drawn, multiplier, how) -> None:
    # (huge finite values overflow a float32 norm: the rescue measures it in float64)
    leaves, counted = drawn
    m = None if multiplier is None or how == "rescue" else torch.scalar_tensor(
        multiplier, dtype=torch.float32)
    options = {"rescue": True} if how == "rescue" else {"accumulate": how}
    measured = []
    for idx, squares in stats.square_groups(leaves, counted, m, **options):
        assert len({(leaves[i].device, leaves[i].dtype) for i in idx}) == 1
        measured += idx
        for i, s in zip(idx, squares, strict=True):
            assert_bitwise_equal(s, _square(leaves[i], m, **options))
    assert sorted(measured) == [i for i, c in enumerate(counted) if c]


_SPECIAL = st.sampled_from([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-30, 3e38, -2.5])


@given(
    st.lists(st.tuples(st.sampled_from([torch.bfloat16, torch.float16, torch.float32,
                                        torch.float64]),
                       st.integers(0, 5), st.booleans(),
                       st.one_of(st.floats(-1e3, 1e3, width=32), _SPECIAL)),
             min_size=1, max_size=9),
    st.one_of(st.floats(0.0, 2.0**126, width=32), st.sampled_from([0.0, math.inf, 2.0**-149])),
)
def test_host_variant_is_the_tensor_arithmetic(leaves, inv) -> None:
    # per leaf (dtype, size, counted, a value put in it): the host form's squares and the
    # sums made of them, bitwise the tensor form's (nan and inf norms, an overflow of the
    # product, a zero or subnormal multiplier included)
    gen = torch.Generator().manual_seed(len(leaves))
    tensors, counted = [], []
    for dtype, size, count, value in leaves:
        t = (torch.randn(size, generator=gen, dtype=torch.float64) * 1e2).to(dtype)
        if size:
            t[0] = value
        tensors.append(t)
        counted.append(count)
    want = stats.square_groups(tensors, counted, torch.scalar_tensor(inv, dtype=torch.float32))
    got = stats.square_groups(tensors, counted, host=inv)
    assert [idx for idx, _ in got] == [idx for idx, _ in want]
    for (_, a), (_, b) in zip(got, want, strict=True):
        assert_bitwise_equal(a, b)
    for leaves_of in (None, [i for i, c in enumerate(counted) if c][::-1], [0]):
        a = stats.sum_squares(want, leaves_of, _CPU)
        b = stats.sum_squares(got, leaves_of, _CPU)
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert_bitwise_equal(a, b)


@given(_leaves(), st.data())
def test_clip_sums_are_the_definition(drawn, data) -> None:
    leaves, counted = drawn
    n = len(leaves)
    clips = data.draw(st.lists(st.permutations(range(n)).flatmap(
        lambda order: st.integers(0, n).map(lambda k: order[:k])), max_size=3))
    got = stats.clip_sums(leaves, counted, clips, _CPU)
    assert len(got) == len(clips)
    for leaves_of, total in zip(clips, got, strict=True):
        wide = any(leaves[i] is not None and leaves[i].dtype == torch.float64
                   for i in leaves_of)
        parts = [_square(leaves[i], rescue=not wide,
                         accumulate=torch.float64 if wide else None)
                 for i in leaves_of if counted[i]]
        want = torch.stack(parts).sum() if parts else torch.zeros((), dtype=torch.float64)
        assert_bitwise_equal(total, want)


@given(_leaves(), st.data())
def test_nonfinite_counts_are_the_definition(drawn, data) -> None:
    leaves, counted = drawn
    n = len(leaves)
    guards = data.draw(st.lists(st.lists(st.integers(0, n - 1), unique=True), max_size=3)
                       if n else st.just([[]]))
    got = stats.nonfinite_counts(leaves, counted, guards, _CPU)
    for leaves_of, count in zip(guards, got, strict=True):
        want = sum(1 for i in leaves_of if counted[i] and not bool(
            torch.isfinite(leaves[i]).all()))
        assert_bitwise_equal(count, torch.tensor(float(want), dtype=torch.float64))


class _Norms(TorchDispatchMode):
    """Counts the ``foreach`` norm calls (one read of a group's gradients each)."""

    calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch.ops.aten._foreach_norm.Scalar
        return func(*args, **(kwargs or {}))


def test_each_statistic_reads_a_group_once_and_an_unasked_one_reads_nothing() -> None:
    # float32 and float64 leaves: two groups; a clip over a float64 leaf measures every
    # leaf in float64 only (not also in float32)
    leaves, counted = [torch.ones(3), torch.ones(2, dtype=torch.float64), torch.ones(())], [True] * 3
    for measure, runs, reads in ((stats.clip_sums, [], 0), (stats.nonfinite_counts, [], 0),
                                 (stats.clip_sums, [[0, 1, 2]], 2),
                                 (stats.nonfinite_counts, [[0, 1, 2], [1]], 2)):
        with _Norms() as norms:
            assert len(measure(leaves, counted, runs, _CPU)) == len(runs)
        assert norms.calls == reads, (measure.__name__, runs)


@given(_leaves(), st.booleans())
def test_unscaled_stats_are_local_stats_but_the_nonfinite_count(drawn, count_zeros) -> None:
    leaves, counted = drawn
    got = stats.unscaled_stats(leaves, counted, _CPU, count_zeros)
    want = stats.local_stats(leaves, str, _CPU, counted)
    assert_bitwise_equal(got[0], want[0])
    assert float(got[1]) == 0.0
    assert_bitwise_equal(got[2], want[2] if count_zeros else torch.zeros((), dtype=torch.float64))


@given(_leaves())
def test_zero_count_is_the_definition(drawn) -> None:
    leaves, counted = drawn
    chosen = [x for x, c in zip(leaves, counted, strict=True) if c]
    got = stats.zero_count(chosen, _CPU)
    if not chosen:
        assert got is None
        return
    want = float(sum(int((x == 0).sum()) for x in chosen))
    assert_bitwise_equal(got, torch.tensor(want, dtype=torch.float64))


@given(_leaves())
def test_public_entry_points_are_views_of_local_stats(drawn) -> None:
    leaves, _ = drawn
    before = clone_tree(leaves)
    rows = [_ops._leaf_stats(x) for x in leaves if x is not None]
    want = torch.stack(rows).sum(dim=0) if rows else torch.zeros(3, dtype=torch.float64)
    assert want.dtype == torch.float64 and want.shape == (3,)
    assert_bitwise_equal(stats.local_stats(leaves, str, _CPU), want)
    assert_bitwise_equal(grad_stats(leaves), want)
    assert_bitwise_equal(fdist.local_grad_stats(leaves), want)
    assert_bitwise_equal(fdist.global_grad_stats(leaves), want)
    assert_bitwise_equal(leaves, before)  # pure


def test_parts_and_sums_round_trip_without_a_group() -> None:
    parts = [torch.tensor(1.5, dtype=torch.float64), torch.tensor(2.0, dtype=torch.float64)]
    assert stats.all_reduce_parts(parts, None) == parts
    totals = {3: (torch.tensor(1.0), torch.tensor(2.0, dtype=torch.float64)),
              7: (torch.tensor(4.0, dtype=torch.bfloat16),)}
    packed = stats.pack_sums(totals)
    assert all(t.dtype == torch.float64 for t in packed)
    back = stats.unpack_sums(totals, [t * 2 for t in packed])
    assert list(back) == [3, 7]
    assert [t.dtype for t in back[3] + back[7]] == [torch.float32, torch.float64,
                                                    torch.bfloat16]
    assert [float(t) for t in back[3] + back[7]] == [2.0, 4.0, 8.0]

