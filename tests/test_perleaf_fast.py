"""The planner's per-leaf tier (functopt/fast/_perleaf.py): Muon, and the trust ratio of
LAMB and LARS.

The references are the pure transforms (``update`` then ``apply_updates``); Muon's pure
path is itself held to optax.contrib in tests/test_contrib.py, LAMB's and LARS's to their
references in tests/test_optimizers.py. The tier must equal it:
bitwise where it runs the same arithmetic (the foreach momentum, the rules' own updates,
the grouped apply), and where it batches Newton-Schulz over same-shape matrices, to the
conformance law's tolerance (float64 1e-12 relative, float32 a few ulps).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functopt
from functopt import contrib
from functopt.contrib import _muon
from functopt.fast import FastPathWarning
from functopt.precision import mixed_precision
from functopt.testing import assert_bitwise_equal, conformance

DN = contrib.MuonDimensionNumbers


def _pure(tx: Any, grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
    updates, state = tx.update(grads, state, params)
    return functopt.apply_updates(params, updates), state


def _fast(step: Any, grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", FastPathWarning)  # the tier was asked for: no loss
        out: tuple[Any, Any] = step(grads, state, params)
    return out


def _model(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """Three same-shape matrices (one batch), a transposed one of that shape, a wide and
    an empty matrix, a vector, a 0-d scalar and an empty vector."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=dtype)

    return {"a": r(6, 4), "b": r(6, 4), "c": r(6, 4), "t": r(4, 6).T, "wide": r(3, 7),
            "empty": r(0, 5), "bias": r(4), "scale": r(()), "none": r(0)}


def _grads_like(params: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g, dtype=v.dtype).as_strided(v.shape, v.stride())
            if v.numel() else torch.zeros_like(v) for k, v in params.items()}


def test_explain_names_the_per_leaf_groups_and_their_rules() -> None:
    params = _model(torch.float32)
    got = functopt.fast.explain(contrib.muon(0.02), params)
    assert got.fast and got.reason is None
    by_rules = {g.rules: set(g.leaves) for g in got.groups}
    assert {g.kernel for g in got.groups} == {"per-leaf"}
    assert by_rules[("scale_by_muon", "muon_shape_factor", "add_decayed_weights",
                     "scale_by_learning_rate")] == {"a", "b", "c", "t", "wide", "empty"}
    # Adam with nesterov (muon passes its nesterov on) has no kernel: it rides the tier
    assert by_rules[("scale_by_adam", "add_decayed_weights", "scale_by_learning_rate")] == {
        "bias", "scale", "none"}
    # without nesterov the Adam leaves keep PyTorch's fused AdamW
    plain = functopt.fast.explain(contrib.muon(0.02, nesterov=False), params)
    assert {g.kernel for g in plain.groups} == {"per-leaf", "torch._fused_adamw_"}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("donate", [False, True])
def test_muon_fast_equals_pure_over_steps(dtype: torch.dtype, donate: bool) -> None:
    tx = contrib.muon(0.05, weight_decay=0.1, weight_decay_mask=lambda p: {
        k: v is not None and k != "wide" for k, v in p.items()})
    step = functopt.fast.make_step(tx, donate=donate)
    params = _model(dtype)
    pure_p, pure_s = params, tx.init(params)
    fast_p, fast_s = {k: v.clone() for k, v in params.items()}, tx.init(params)
    for i in range(4):
        grads = _grads_like(params, seed=10 + i)
        pure_p, pure_s = _pure(tx, grads, pure_s, pure_p)
        before = fast_p
        fast_p, fast_s = _fast(step, grads, fast_s, fast_p)
        if donate:  # written where they are
            assert all(fast_p[k] is before[k] for k in params)
    # measured bitwise here (each batch stacks matrices in their own layout); the law's
    # tolerance is the bound the tier promises
    assert_bitwise_equal(fast_p, pure_p)
    assert_bitwise_equal(fast_s, pure_s)
    assert fast_p["t"].stride() == params["t"].stride()


@pytest.mark.parametrize("mask", [None, {"a": True, "b": False, "c": True, "t": False,
                                         "wide": True, "empty": False}],
                         ids=["one group", "a decay mask: two groups"])
def test_newton_schulz_runs_once_per_shape_not_once_per_matrix(
        monkeypatch: pytest.MonkeyPatch, mask: Any) -> None:
    seen: list[tuple[int, ...]] = []
    real = _muon._orthogonalize

    def counting(x: torch.Tensor, *args: Any) -> torch.Tensor:
        seen.append(tuple(x.shape))
        return real(x, *args)

    monkeypatch.setattr(_muon, "_orthogonalize", counting)
    params = _model(torch.float32)
    tx = contrib.muon(0.02, weight_decay=0.1, weight_decay_mask=None if mask is None else (
        lambda p: {k: mask.get(k, False) for k in p}))
    grads = _grads_like(params, seed=1)
    groups = functopt.fast.explain(tx, params).groups
    assert len(groups) == (2 if mask is None else 3)
    seen.clear()  # (explain counts the step's memory traffic on meta tensors: not the step)
    _fast(functopt.fast.make_step(tx), grads, tx.init(params), params)
    # a, b, c stacked (across the groups a mask makes: the rules run rule-major); t apart
    # (its columns are contiguous); wide and empty alone
    assert sorted(seen) == sorted([(3, 6, 4), (1, 6, 4), (1, 3, 7), (1, 0, 5)])
    seen.clear()
    tx.update(grads, tx.init(params), params)
    assert len(seen) == 6  # the pure path: one iteration per matrix


@pytest.mark.parametrize(("ns_dtype", "cap"), [(None, 2 * 24 * 4), (torch.bfloat16, 2 * 24 * 2)],
                         ids=["float32 iteration", "bfloat16 iteration"])
def test_batches_hold_at_most_the_cap_in_bytes_and_equal_the_pure_step(
        monkeypatch: pytest.MonkeyPatch, ns_dtype: Any, cap: int) -> None:
    # a cap of two 6 x 4 matrices (counted in the iteration's dtype): a, b, c go as a batch
    # of two and one; t (columns contiguous), wide and empty alone; and the step is the pure
    # one, over steps, in either dtype of the iteration
    seen: list[tuple[tuple[int, ...], torch.dtype]] = []
    real = _muon._orthogonalize

    def counting(x: torch.Tensor, *args: Any) -> torch.Tensor:
        seen.append((tuple(x.shape), x.dtype))
        return real(x, *args)

    monkeypatch.setattr(_muon, "_orthogonalize", counting)
    monkeypatch.setitem(_muon._BATCH_BYTES, "cpu", cap)
    tx = contrib.muon(0.05, weight_decay=0.1, ns_dtype=ns_dtype)
    step = functopt.fast.make_step(tx)
    params = _model(torch.float32)
    pure_p, pure_s = params, tx.init(params)
    fast_p, fast_s = params, tx.init(params)
    for i in range(3):
        grads = _grads_like(params, seed=40 + i)
        seen.clear()
        fast_p, fast_s = _fast(step, grads, fast_s, fast_p)
        assert sorted(shape for shape, _ in seen) == sorted(
            [(2, 6, 4), (1, 6, 4), (1, 6, 4), (1, 3, 7), (1, 0, 5)])
        assert {dtype for _, dtype in seen} == {ns_dtype or torch.float32}
        pure_p, pure_s = _pure(tx, grads, pure_s, pure_p)
    assert_bitwise_equal(fast_p, pure_p)  # measured bitwise here, as uncapped
    assert_bitwise_equal(fast_s, pure_s)


def test_on_the_cpu_a_batch_holds_at_most_256_kib() -> None:
    # a 256 x 256 float32 matrix fills a batch: it runs alone, as every larger one does
    assert _muon._chunks([torch.zeros(1, 256, 256)] * 2, None) == [[0], [1]]
    assert _muon._chunks([torch.zeros(2, 512, 512)] * 2, None) == [[0], [1]]
    small = [torch.zeros(1, 64, 64)] * 70  # 16 KiB each in float32, 8 KiB in bfloat16
    assert [len(c) for c in _muon._chunks(small, None)] == [16, 16, 16, 16, 6]
    assert [len(c) for c in _muon._chunks(small, torch.bfloat16)] == [32, 32, 6]


def test_dimension_numbers_channels_last_and_a_leading_clip() -> None:
    # a conv kernel (out, in, kh, kw) in channels_last memory, read with dimension numbers,
    # two of them (one batch), behind a global-norm clip folded into the tier
    g = torch.Generator().manual_seed(3)
    conv = {f"k{i}": torch.randn(4, 3, 2, 2, generator=g, dtype=torch.float64).to(
        memory_format=torch.channels_last) for i in range(2)}
    params = {**conv, "bias": torch.randn(4, generator=g, dtype=torch.float64)}
    dims = {"k0": DN((1, 2, 3), 0), "k1": DN((1, 2, 3), 0), "bias": None}
    tx = functopt.chain(functopt.clip_by_global_norm(0.5),
                        contrib.muon(0.1, muon_weight_dimension_numbers=dims))
    explained = functopt.fast.explain(tx, params)
    assert explained.fast and explained.clips == 1 and all(g.clip for g in explained.groups)
    conformance.check_fast_path(tx, params, _grads_like(params, 4), steps=3)
    step, state = functopt.fast.make_step(tx), tx.init(params)
    fast = _fast(step, _grads_like(params, 4), state, params)
    pure = _pure(tx, _grads_like(params, 4), state, params)
    torch.testing.assert_close(fast[0], pure[0], rtol=1e-12, atol=0)


@settings(max_examples=6, deadline=None)
@given(shapes=st.lists(st.sampled_from([(2, 3), (3, 2), (4, 4), (1, 5), (5, 1), (0, 3)]),
                       min_size=1, max_size=6),
       transposed=st.lists(st.booleans(), min_size=6, max_size=6),
       dtype=st.sampled_from([torch.float64, torch.float32]),
       nesterov=st.booleans(), preconditioning=st.sampled_from(_muon._PRECONDITIONINGS),
       adaptive=st.booleans(), seed=st.integers(0, 2**16))
def test_fast_path_law_on_drawn_matrices(shapes: list[tuple[int, int]], transposed: list[bool],
                                         dtype: torch.dtype, nesterov: bool,
                                         preconditioning: Any, adaptive: bool,
                                         seed: int) -> None:
    # repeated shapes (batched), transposed layouts (batched apart), every preconditioning
    g = torch.Generator().manual_seed(seed)
    params: dict[str, torch.Tensor] = {}
    for i, (m, n) in enumerate(shapes):
        x = torch.randn(n, m, generator=g, dtype=dtype).T if transposed[i] else torch.randn(
            m, n, generator=g, dtype=dtype)
        params[f"m{i}"] = x
    params["v"] = torch.randn(3, generator=g, dtype=dtype)
    grads = _grads_like(params, seed + 1)
    tx = contrib.muon(0.03, nesterov=nesterov, adaptive=adaptive,
                      preconditioning=preconditioning, weight_decay=0.01)
    assert functopt.fast.explain(tx, params).fast
    conformance.check_fast_path(tx, params, grads, steps=2)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 5), dtype=st.sampled_from([torch.float64, torch.float32]),
       mu_dtype=st.sampled_from([None, torch.bfloat16, torch.float64]),
       nesterov=st.booleans(), count=st.integers(0, 50), seed=st.integers(0, 2**16))
def test_foreach_momentum_is_bitwise_the_per_leaf_momentum(
        n: int, dtype: torch.dtype, mu_dtype: torch.dtype | None, nesterov: bool, count: int,
        seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(3, i + 1, generator=g, dtype=dtype) for i in range(n)]
    mus = [torch.randn(x.shape, generator=g, dtype=mu_dtype or dtype) for x in grads]
    c = torch.tensor(count + 1, dtype=torch.int32)
    bc = functopt.transforms._common.bias_correction(0.95, c)
    bc_next = functopt.transforms._common.bias_correction(0.95, c + 1)
    expected = _muon._momentum(grads, mus, 0.95, bc, bc_next, nesterov)
    got = _muon._momentum_grouped(grads, mus, 0.95, bc, bc_next, nesterov)
    assert_bitwise_equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_batched_newton_schulz_is_within_the_law_of_per_matrix(dtype: torch.dtype) -> None:
    # the one place the tier's arithmetic may differ: a batched product per shape. Measured
    # here: float32 bitwise; float64 bitwise but for the 33 x 17 stack (iterated on its
    # transpose), which differs by up to 1.6e-15 (10 ulps of its largest entry)
    g = torch.Generator().manual_seed(5)
    mats = [torch.randn(33, 17, generator=g, dtype=dtype) for _ in range(4)]
    dims = [DN()] * len(mats)
    rows = [tuple(_muon._DEFAULT_NS_COEFFS)] * 5
    single = [_muon._update_of(x, DN(), dtype, rows, "frobenius", 1e-8, False, None, False)
              for x in mats]
    batched = _muon._updates_batched(mats, dims, [dtype] * len(mats), rows, "frobenius",
                                     1e-8, False, None, False)
    rel = 1e-12 if dtype == torch.float64 else 3 * torch.finfo(dtype).eps
    for s, b in zip(single, batched, strict=True):
        assert float((s - b).abs().max()) <= rel * float(s.abs().max())


@pytest.mark.parametrize("frozen", [("a",), ("a", "b", "c", "t", "wide", "empty")],
                         ids=["one matrix", "every matrix"])
def test_leaves_without_a_gradient(frozen: tuple[str, ...]) -> None:
    # a None gradient leaves its param and momentum as they were; with no matrix to
    # update, Muon's count still advances as on the pure path
    tx = contrib.muon(0.02)
    params = _model(torch.float64)
    state = tx.init(params)
    step = functopt.fast.make_step(tx)
    for i in range(2):
        grads: dict[str, Any] = dict(_grads_like(params, 40 + i))
        grads.update({k: None for k in frozen})
        fast_p, fast_s = _fast(step, grads, state, params)
        pure_p, pure_s = _pure(tx, grads, state, params)
        assert_bitwise_equal(fast_p, pure_p)
        assert_bitwise_equal(fast_s, pure_s)
        params, state = pure_p, pure_s
    assert all(torch.equal(params[k], _model(torch.float64)[k]) for k in frozen)


@pytest.mark.parametrize("donate", [False, True])
def test_a_skipped_step_keeps_params_and_state(donate: bool) -> None:
    tx = functopt.apply_if_finite(contrib.muon(0.02), max_consecutive_errors=3)
    params = _model(torch.float64)
    state = tx.init(params)
    grads = _grads_like(params, 7)
    grads["a"] = grads["a"].clone()
    grads["a"][0, 0] = float("inf")
    pure_p, pure_s = _pure(tx, grads, state, params)
    before = {k: v.clone() for k, v in params.items()}
    fast_p, fast_s = _fast(functopt.fast.make_step(tx, donate=donate), grads,
                           functopt.tree.map(torch.clone, state), params)
    assert_bitwise_equal(fast_p, before)
    assert_bitwise_equal(fast_p, pure_p)
    assert_bitwise_equal(fast_s, pure_s)
    assert int(fast_s.notfinite_count) == 1


def test_mixed_precision_muon_takes_the_tier_and_equals_its_pure_path() -> None:
    full = {k: v.to(torch.bfloat16) for k, v in _model(torch.float32).items()}
    fast = mixed_precision(contrib.muon(0.02), max_grad_norm=1.0)
    pure = mixed_precision(contrib.muon(0.02), max_grad_norm=1.0, fused=False)
    fp, fs = full, fast.init(full)
    pp, ps = full, pure.init(full)
    for i in range(4):
        grads = {k: v.to(torch.bfloat16) for k, v in _grads_like(
            {k: v.float() for k, v in full.items()}, 20 + i).items()}
        if i == 2:  # an overflow: the step is skipped on both paths
            grads["a"] = grads["a"].clone()
            grads["a"][1, 1] = float("inf")
        masters = {k: v.clone() for k, v in fs.master.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("error", FastPathWarning)
            fp, fs = fast.step(grads, fs, fp)
        pp, ps = pure.step(grads, ps, pp)
        if i == 2:
            assert_bitwise_equal(fs.master, masters)
    torch.testing.assert_close(fs.master, ps.master, rtol=0, atol=2e-7)
    for k, p in fp.items():
        assert p.dtype == torch.bfloat16
        assert torch.equal(fs.master[k].to(torch.bfloat16), p), k


@pytest.mark.parametrize(("build", "reason"), [
    (lambda: functopt.chain(contrib.muon(0.02), functopt.clip_by_global_norm(1.0)),
     "takes clip_by_global_norm only before the rules"),
    (lambda: functopt.chain(functopt.adafactor(0.02), functopt.clip_by_global_norm(1.0)),
     "takes clip_by_global_norm only before the rules"),
], ids=["muon_late_clip", "adafactor_late_clip"])
def test_what_the_tier_refuses_is_explained_and_warned(build: Any, reason: str) -> None:
    params = _model(torch.float32)
    tx = build()
    explained = functopt.fast.explain(tx, params)
    assert not explained.fast and reason in str(explained.reason), explained.reason
    state = tx.init(params)
    grads = _grads_like(params, 2)
    with torch.no_grad(), pytest.warns(FastPathWarning, match=reason):
        new, _ = functopt.fast.make_step(tx)(grads, state, params)
    assert_bitwise_equal(new, _pure(tx, grads, state, params)[0])


_INJECTED = {
    "muon": lambda: functopt.inject_hyperparams(contrib.muon)(learning_rate=0.02,
                                                              weight_decay=0.01),
    "adafactor": lambda: functopt.inject_hyperparams(functopt.adafactor)(
        learning_rate=0.02, weight_decay_rate=0.01),
    "lamb": lambda: functopt.inject_hyperparams(functopt.lamb)(learning_rate=0.02,
                                                               weight_decay=0.01),
    # an injection inside another: the inner one as built from the outer's values (here its
    # schedule reads the outer's peak), with its own values (learning_rate, weight_decay)
    "nested muon": lambda: functopt.inject_hyperparams(
        lambda peak: functopt.inject_hyperparams(contrib.muon)(
            learning_rate=0.02, weight_decay=lambda count: peak * 0.5 ** count))(peak=0.01),
}


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("name", sorted(_INJECTED))
def test_injected_hyperparameters_take_the_tier_and_are_read_at_every_step(
        name: str, donate: bool) -> None:
    # a scheduler (or functopt.Optimizer's param_groups) writes new values into
    # state.hyperparams between steps: the tier runs the inner transform built from them,
    # bitwise the pure inject_hyperparams
    tx = _INJECTED[name]()
    params = _model(torch.float64)
    explained = functopt.fast.explain(tx, params)
    assert explained.fast and "per-leaf" in str(explained), explained
    state = tx.init(params)
    step = functopt.fast.make_step(tx, donate=donate)
    for i, (lr, decay) in enumerate([(0.02, 0.01), (0.005, 0.0), (0.05, 0.2)]):
        if name == "nested muon":  # (the inner's lr, the outer's peak of its decay schedule)
            inner = state.inner_state._replace(hyperparams={
                **state.inner_state.hyperparams,
                "learning_rate": torch.tensor(lr, dtype=torch.float64)})
            state = state._replace(inner_state=inner, hyperparams={
                "peak": torch.tensor(decay, dtype=torch.float64)})
        else:
            hyper = {**state.hyperparams,
                     "learning_rate": torch.tensor(lr, dtype=torch.float64)}
            key = "weight_decay_rate" if name == "adafactor" else "weight_decay"
            hyper[key] = torch.tensor(decay, dtype=torch.float64)
            state = state._replace(hyperparams=hyper)
        grads = _grads_like(params, 20 + i)
        pure_p, pure_s = _pure(tx, grads, state, params)
        fast_p, fast_s = _fast(step, grads, functopt.tree.map(torch.clone, state),
                               {k: v.clone() for k, v in params.items()})
        assert_bitwise_equal(fast_p, pure_p)
        assert_bitwise_equal(fast_s, pure_s)
        params, state = pure_p, pure_s


@pytest.mark.parametrize("name", ["adafactor", "lamb"])
def test_optimizer_over_a_per_leaf_recipe_stays_fast_under_a_scheduler(name: str) -> None:
    # functopt.Optimizer lifts a plain recipe into inject_hyperparams: the tier takes it,
    # and a torch scheduler's lr reaches it at every step as on the pure path
    recipe = {"adafactor": functopt.adafactor, "lamb": functopt.lamb}[name]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3)).double()
    twin = {k: v.detach().clone() for k, v in model.named_parameters()}
    runs = []
    for fused, scheduled in ((True, True), (False, True), (True, False)):
        params = [torch.nn.Parameter(twin[k].clone()) for k in sorted(twin)]
        opt = functopt.Optimizer(params, recipe(0.05), fused=fused)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for i in range(3):
            g = torch.Generator().manual_seed(i)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
            with warnings.catch_warnings():
                warnings.simplefilter("error", FastPathWarning)
                opt.step()
            if scheduled:
                sched.step()
        runs.append([p.detach() for p in params])
    assert_bitwise_equal(runs[0], runs[1])
    # the scheduler's lr took effect: without it the same steps end elsewhere
    assert not torch.equal(runs[0][0], runs[2][0])


def test_transforms_without_a_per_leaf_rule_do_not_get_the_tier() -> None:
    # the tier hosts rules without a kernel only beside a per-leaf rule: lion alone still
    # says it lost the fast path
    got = functopt.fast.explain(functopt.lion(1e-4), {"w": torch.zeros(3)})
    assert not got.fast and "per-leaf" not in str(got.reason)


# --- the trust ratio (LAMB, LARS) ----------------------------------------------------------

def test_lamb_and_lars_take_the_tier() -> None:
    params = _model(torch.float32)
    lamb = functopt.fast.explain(functopt.lamb(1e-3, weight_decay=0.01), params)
    assert lamb.fast and [g.kernel for g in lamb.groups] == ["per-leaf"]
    assert lamb.groups[0].rules == ("scale_by_adam", "add_decayed_weights",
                                    "scale_by_trust_ratio", "scale_by_learning_rate")
    assert functopt.fast.explain(functopt.lars(0.1), params).fast


@pytest.mark.parametrize("build", [
    lambda: functopt.lamb(1e-2, weight_decay=0.01),
    lambda: functopt.lars(0.1, weight_decay=1e-3, trust_ratio_mask=lambda p: {
        k: v is not None and v.dim() > 1 for k, v in p.items()}),
    lambda: functopt.chain(functopt.scale_by_adam(), functopt.scale_by_trust_ratio(
        min_norm=0.5, trust_coefficient=0.3, eps=1e-3), functopt.scale(-0.1)),
], ids=["lamb", "lars[mask]", "trust_ratio[min_norm,eps]"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_trust_ratio_fast_equals_pure_bitwise(build: Any, dtype: torch.dtype) -> None:
    # the grouped ratio (two foreach norms per group, the ratios as one vector) runs the
    # pure path's elementwise operations; torch._foreach_norm was bitwise vector_norm here
    tx = build()
    params = _model(dtype)
    params["zero"] = torch.zeros(3, 2, dtype=dtype)  # a param at zero: ratio 1
    step = functopt.fast.make_step(tx)
    pure_p, pure_s = params, tx.init(params)
    fast_p, fast_s = params, tx.init(params)
    for i in range(3):
        grads = _grads_like(params, 30 + i)
        pure_p, pure_s = _pure(tx, grads, pure_s, pure_p)
        fast_p, fast_s = _fast(step, grads, fast_s, fast_p)
    assert_bitwise_equal(fast_p, pure_p)
    assert_bitwise_equal(fast_s, pure_s)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_many_large_matrices_fast_equals_pure(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(11)
    params = {f"w{i}": torch.randn(64, 48, generator=g, dtype=dtype) for i in range(12)}
    params.update({f"u{i}": torch.randn(128, 32, generator=g, dtype=dtype).T for i in range(4)})
    params.update({f"b{i}": torch.randn(48, generator=g, dtype=dtype) for i in range(12)})
    conformance.check_fast_path(contrib.muon(0.02, weight_decay=0.01), params,
                                _grads_like(params, 12), steps=4)


@pytest.mark.slow
# (importing Inductor on the CPU defines torch.utils.mkldnn's ScriptModules, which warn)
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_with_compile_the_adam_leaves_compile_and_the_matrices_stay_per_leaf() -> None:
    tx = contrib.muon(0.02)
    params = _model(torch.float32)
    explained = functopt.fast.explain(tx, params, compile=True)
    assert {g.kernel for g in explained.groups} == {"per-leaf", "compiled"}
    conformance.check_fast_path(tx, params, _grads_like(params, 50), steps=2, compile=True)
