"""The planner's compiled tier (``make_step(tx, compile=True)``): elementwise rules without a
PyTorch kernel, one compiled call per group, held to the pure path.

Each distinct group compiles once per process (seconds on this machine; Inductor's cache
makes reruns faster), so the default run keeps to a few chains that cover the mechanism;
``-m slow`` runs every compiled rule.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from compiled_cases import every_layout, grads_for

import functopt
from functopt import fast
from functopt.testing import clone_tree, conformance
from functopt.tree import _core

# Importing Inductor on the CPU defines torch.utils.mkldnn's ScriptModules, which warn.
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def _no_vectors(params: Any) -> Any:
    return {k: v.ndim > 1 for k, v in params.items()}


def _lion() -> functopt.GradientTransformation:
    return functopt.lion(1e-2, weight_decay=0.1)


def _clip_nadam() -> functopt.GradientTransformation:
    return functopt.apply_if_finite(functopt.chain(
        functopt.clip_by_global_norm(0.5), functopt.nadam(1e-2)), max_consecutive_errors=2)


def _masked_schedule() -> functopt.GradientTransformation:
    # two programs (decayed matrices, undecayed vectors): two groups, two compiled calls
    return functopt.chain(
        functopt.scale_by_lion(),
        functopt.add_decayed_weights(0.1, mask=_no_vectors),
        functopt.scale_by_learning_rate(functopt.schedules.cosine_decay_schedule(1e-2, 10)))


def _ademamix() -> functopt.GradientTransformation:
    # functopt.contrib: two momenta and a step count of its own (count_m2) moved by the call
    return functopt.contrib.ademamix(1e-2, weight_decay=0.1)


def _stateless() -> functopt.GradientTransformation:
    # the stateless elementwise transforms: a clip by value, signSGD's sign, the
    # non-negativity constraint (which reads the params)
    return functopt.chain(functopt.clip(0.05), functopt.scale_by_sign(),
                          functopt.scale_by_learning_rate(1e-2),
                          functopt.keep_params_nonnegative())


def _clip_adamw() -> functopt.GradientTransformation:
    # a rule with a PyTorch kernel: with compile=True the compiled tier takes it first
    return functopt.chain(functopt.clip_by_global_norm(0.5),
                          functopt.adamw(1e-2, weight_decay=0.1))


def _late_clip() -> functopt.GradientTransformation:
    # a clip of Adam's updates (not of the gradients): a compiled sums pass measures them
    return functopt.chain(functopt.scale_by_adam(), functopt.clip_by_global_norm(0.05),
                          functopt.add_decayed_weights(0.1),
                          functopt.scale_by_learning_rate(1e-2))


_SLOW = pytest.mark.slow


@pytest.mark.parametrize(("factory", "dtype"), [
    pytest.param(_lion, torch.float64, id="float64-lion"),
    pytest.param(_clip_nadam, torch.float32, id="float32-guard_clip_nadam"),
    pytest.param(_masked_schedule, torch.float64, id="float64-masked_schedule"),
    pytest.param(_ademamix, torch.float64, id="float64-ademamix"),
    pytest.param(_stateless, torch.float32, id="float32-clip_sign_nonnegative"),
    # (seconds each with a cold cache: the default run tests these paths in the tests below)
    pytest.param(_clip_adamw, torch.float32, id="float32-clip_adamw", marks=_SLOW),
    pytest.param(_late_clip, torch.float64, id="float64-late_clip", marks=_SLOW),
    # the other dtype of each (one more compile each: seconds; run with -m slow)
    pytest.param(_lion, torch.float32, id="float32-lion", marks=_SLOW),
    pytest.param(_clip_nadam, torch.float64, id="float64-guard_clip_nadam", marks=_SLOW),
    pytest.param(_masked_schedule, torch.float32, id="float32-masked_schedule", marks=_SLOW),
    pytest.param(_ademamix, torch.float32, id="float32-ademamix", marks=_SLOW),
    pytest.param(_clip_adamw, torch.float64, id="float64-clip_adamw", marks=_SLOW),
    pytest.param(_late_clip, torch.float32, id="float32-late_clip", marks=_SLOW),
])
def test_compiled_tier_obeys_the_fast_path_law(factory: Any, dtype: torch.dtype) -> None:
    """The conformance law (float64 to 1e-12, float32 to a few ulps per step), donated or
    not, with the state as tx.init lays it out and as step.init does, on every layout.
    The default run takes each chain once and each dtype; ``-m slow`` the other dtypes."""
    params = every_layout(dtype)
    tx = factory()
    assert fast.explain(tx, params, compile=True).fast
    assert all(g.kernel == "compiled" for g in fast.explain(tx, params, compile=True).groups)
    conformance.check_fast_path(factory, params, grads_for(params, 1), steps=3, compile=True)


def test_a_skipped_step_keeps_params_and_state() -> None:
    """apply_if_finite folded into the compiled call: a non-finite gradient leaves params
    and moments bitwise as they were, and only the guard's counters move."""
    params = every_layout(torch.float64)
    tx = _clip_nadam()
    step = fast.make_step(tx, compile=True, donate=True)
    state = step.init(params)
    before = _core.flatten(clone_tree(state))[0]
    kept = {k: v.clone() for k, v in params.items()}
    grads = grads_for(params, 2)
    grads["b"][1] = float("nan")
    with torch.no_grad():
        new, state = step(grads, state, params)
    assert all(torch.equal(new[k], kept[k]) for k in params)
    inner = state.inner_state[1][0]  # nadam's moments
    old_inner = _core.unflatten(_core.flatten(state)[1], before).inner_state[1][0]
    for a, b in zip(_core.flatten(inner)[0], _core.flatten(old_inner)[0], strict=True):
        assert torch.equal(a, b)
    assert int(state.notfinite_count) == 1


def test_init_lays_each_state_entry_end_to_end() -> None:
    """step.init: values equal tx.init's, every compiled group's moments are views of one
    buffer with their params' shapes and strides, and a donated step writes into them (the
    returned state holds the same tensors)."""
    params = every_layout(torch.float32)
    tx = _lion()
    step = fast.make_step(tx, compile=True, donate=True)
    state, reference = step.init(params), tx.init(params)
    mu = state[0].mu
    for k, p in params.items():
        assert mu[k].shape == p.shape and (mu[k].stride() == p.stride() or p.numel() <= 1)
        assert torch.equal(mu[k], reference[0].mu[k])
    storages = {mu[k].untyped_storage().data_ptr() for k in params if params[k].numel()}
    assert len(storages) == 1
    pointers = {k: mu[k].data_ptr() for k in params}
    params2 = {k: v.clone() for k, v in params.items()}
    with torch.no_grad():
        _, new_state = step(grads_for(params, 3), state, params)
    assert {k: new_state[0].mu[k].data_ptr() for k in params} == pointers
    assert not torch.equal(new_state[0].mu["w"], reference[0].mu["w"])
    # a state that is not laid out flat (here the reference) still steps, equally
    other = fast.make_step(tx, compile=True, donate=True)
    state2 = tx.init(params2)
    with torch.no_grad():
        other(grads_for(params, 3), state2, params2)
    assert all(torch.equal(params2[k], params[k]) for k in params)


def test_params_in_one_buffer_are_stepped_in_place() -> None:
    """Params that are views of one contiguous buffer (as a contiguous parameter buffer
    gives) are read and written where they are: no copy back."""
    flat = torch.randn(12 + 3, dtype=torch.float64)
    params = {"w": flat[:12].view(4, 3), "b": flat[12:]}
    tx = _lion()
    step = fast.make_step(tx, compile=True, donate=True)
    state = step.init(params)
    reference_params = {k: v.clone() for k, v in params.items()}
    reference_state = tx.init(reference_params)
    grads = grads_for(params, 4)
    with torch.no_grad():
        new, _ = step(grads, state, params)
    updates, _ = tx.update(grads, reference_state, reference_params)
    expected = functopt.apply_updates(reference_params, updates)
    assert new["w"] is params["w"]
    assert torch.equal(flat[:12].view(4, 3), expected["w"])
    assert torch.equal(flat[12:], expected["b"])


def test_lay_out_puts_params_and_grads_in_one_buffer_per_group() -> None:
    """step.lay_out on a module: each compiled group's params and their .grad become views
    of one buffer (params keep identity and values), backward accumulates into the grad
    buffer, the step reads it without gathering a copy and writes the params in place,
    and the trained module equals the pure path's (float32, a few ulps) over three
    steps of two groups (masked decay)."""
    torch.manual_seed(3)

    def model() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(),
                                   torch.nn.Linear(5, 2))

    ours, ref = model(), model()
    ref.load_state_dict(ours.state_dict())
    tx = _masked_schedule()
    step = fast.make_step(tx, compile=True, donate=True)
    before = {k: p.detach().clone() for k, p in ours.named_parameters()}
    objects = dict(ours.named_parameters())
    params = step.lay_out(dict(ours.named_parameters()))
    assert all(params[k] is objects[k] for k in objects)  # the module's own parameters
    assert all(torch.equal(params[k], before[k]) for k in before)
    for group in (("0.weight", "2.weight"), ("0.bias", "2.bias")):  # decayed, not decayed
        for tensors in ([params[k] for k in group], [params[k].grad for k in group]):
            assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    state = step.init(params)
    ref_params = {k: p.detach() for k, p in ref.named_parameters()}
    ref_state = tx.init(ref_params)
    x = torch.randn(16, 6)
    buffers = [p.grad.untyped_storage().data_ptr() for p in params.values()]
    for _ in range(3):
        ours.zero_grad(set_to_none=False)
        ours(x).square().mean().backward()
        grads = {k: p.grad for k, p in params.items()}
        assert [g.untyped_storage().data_ptr() for g in grads.values()] == buffers
        with torch.no_grad():
            new, state = step(grads, state, params)
        assert all(new[k] is params[k] for k in params)
        ref.zero_grad()
        ref(x).square().mean().backward()
        with torch.no_grad():
            updates, ref_state = tx.update({k: p.grad for k, p in ref.named_parameters()},
                                           ref_state, ref_params)
            ref_params = functopt.apply_updates(ref_params, updates)
            for k, p in ref.named_parameters():
                p.copy_(ref_params[k])
    assert not any(key[-1] == "grads" for key in step._scratch())  # read in place
    for k, p in ours.named_parameters():
        torch.testing.assert_close(p.detach(), ref_params[k], rtol=1e-6, atol=1e-7)


def test_lay_out_refuses_what_one_buffer_cannot_hold() -> None:
    """Tied weights and overlapping views (in one group or two) and non-leaf params are
    refused by name; without compile=True nothing moves."""
    step = fast.make_step(_lion(), compile=True)
    w = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="tied weights"):
        step.lay_out({"a": w, "b": w})
    # a row of a matrix in another group (masked decay): two buffers would untie them
    grouped = fast.make_step(_masked_schedule(), compile=True)
    m = torch.nn.Parameter(torch.ones(2, 3))
    with pytest.raises(ValueError, match="share memory"):
        grouped.lay_out({"m": m, "v": m[0]})
    leaf = torch.ones(3, requires_grad=True)
    with pytest.raises(ValueError, match="param 'v' is not a leaf"):
        step.lay_out({"u": torch.ones(2), "v": leaf * 2})
    plain = fast.make_step(_lion())
    p = {"a": torch.ones(2), "b": torch.ones(2)}
    ptrs = [t.data_ptr() for t in p.values()]
    assert plain.lay_out(p) is p and [t.data_ptr() for t in p.values()] == ptrs


def test_two_threads_step_their_own_states() -> None:
    """One donating step function, two threads, two models: the gathered copies are per
    thread, so each result equals stepping alone."""
    tx = _lion()
    step = fast.make_step(tx, compile=True, donate=True)
    models = [every_layout(torch.float32, seed) for seed in (5, 6)]
    alone = [{k: v.clone() for k, v in m.items()} for m in models]
    grads = [grads_for(m, 7 + i) for i, m in enumerate(models)]
    solo = fast.make_step(tx, compile=True, donate=True)
    for m, g in zip(alone, grads, strict=True):
        s = tx.init(m)
        with torch.no_grad():
            for _ in range(5):
                m, s = solo(g, s, m)
    states = [tx.init(m) for m in models]
    errors: list[BaseException] = []

    def train(i: int) -> None:
        try:
            m, s = models[i], states[i]
            with torch.no_grad():
                for _ in range(5):
                    m, s = step(grads[i], s, m)
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=train, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    for m, a in zip(models, alone, strict=True):
        assert all(torch.equal(m[k], a[k]) for k in m)


@pytest.mark.parametrize("nested", [False, True])
def test_injected_hyperparameters_are_read_at_every_step(nested: bool) -> None:
    """inject_hyperparams(lion) with a scheduled learning rate, and its weight decay and b1
    edited in the state between steps (as a torch scheduler or a user would): the compiled
    tier runs the rule built from each step's values, equal to the pure path (float64 to
    1e-12) on every layout, and one graph serves every value (no recompile). ``nested``: the
    same inside another inject_hyperparams whose value the schedule reads (its peak, edited
    too): the rule is the one of the inner injection built from the outer's values."""
    params = every_layout(torch.float64)

    def lion(peak: Any) -> functopt.GradientTransformation:
        return functopt.inject_hyperparams(functopt.lion)(
            learning_rate=functopt.schedules.linear_schedule(peak, 1e-3, 4), b1=0.9,
            weight_decay=0.1)

    tx = functopt.inject_hyperparams(lion)(peak=1e-2) if nested else lion(1e-2)
    assert fast.explain(tx, params, compile=True).fast
    step = fast.make_step(tx, compile=True)
    state_fast, state_pure = step.init(params), tx.init(params)
    p_fast, p_pure = clone_tree(params), clone_tree(params)
    for i in range(4):
        if i == 2:  # new values between steps, in both states
            for state in (state_fast, state_pure):
                inner = state.inner_state if nested else state
                inner.hyperparams["weight_decay"].fill_(0.3)
                inner.hyperparams["b1"].fill_(0.5)
                if nested:
                    state.hyperparams["peak"].fill_(5e-2)
        grads = grads_for(params, 10 + i)
        with torch.no_grad():
            p_fast, state_fast = step(grads, state_fast, p_fast)
        updates, state_pure = tx.update(grads, state_pure, p_pure)
        p_pure = functopt.apply_updates(p_pure, updates)
        for k in params:
            torch.testing.assert_close(p_fast[k], p_pure[k], rtol=1e-12, atol=1e-14)
    (structure,) = step.planner._cache.values()
    (fn,) = structure.compiled.values()
    code = fn._torchdynamo_orig_callable.__code__
    # one compiled graph (Dynamo's cache entries of the group's code) for every step's values
    assert len(torch._dynamo.eval_frame._debug_get_cache_entry_list(code)) == 1


def test_what_the_tier_does_not_lower_is_said() -> None:
    params = {"w": torch.zeros(3)}
    plain = fast.explain(functopt.lion(1e-3), params)
    assert not plain.fast and "make_step(tx, compile=True) compiles it" in str(plain.reason)
    # (a guard after other rules compiles around stateless rules: tests/test_late_guard.py)
    late_guard = functopt.chain(functopt.scale_by_lion(), functopt.apply_if_finite(
        functopt.trace(0.9), max_consecutive_errors=2))
    got = fast.explain(late_guard, params, compile=True)
    assert not got.fast and "apply_if_finite after other rules has a fast form" in str(
        got.reason)


@pytest.mark.slow
@pytest.mark.parametrize("factory", [
    lambda: functopt.radam(1e-2), lambda: functopt.adamax(1e-2),
    lambda: functopt.adadelta(1.0), lambda: functopt.rprop(1e-2),
    lambda: functopt.adamw(1e-2, nesterov=True),
    lambda: functopt.chain(functopt.dampened_trace(0.9, 0.1),
                           functopt.scale_by_learning_rate(1e-2)),
    lambda: functopt.rmsprop(1e-2, momentum=0.9), lambda: functopt.rmsprop(1e-2, centered=True),
    lambda: functopt.adagrad(1e-2),
    lambda: functopt.contrib.adopt(1e-2), lambda: functopt.contrib.simplified_ademamix(1e-2),
    lambda: functopt.contrib.madgrad(1e-2),
    lambda: functopt.contrib.madgrad(1e-2, weight_decay=0.1, decouple_decay=True),
    # rules the kernels have, which compile=True compiles
    lambda: functopt.chain(functopt.add_decayed_weights(0.1), functopt.adam(1e-2)),
    lambda: functopt.amsgrad(1e-2),
    lambda: functopt.chain(functopt.add_decayed_weights(0.1),
                           functopt.sgd(1e-2, momentum=0.9, nesterov=True)),
    lambda: functopt.adamw(1e-2, mu_dtype=torch.float32),
], ids=["radam", "adamax", "adadelta", "rprop", "nadamw", "dampened_sgd", "rmsprop_momentum",
        "rmsprop_centered", "adagrad", "adopt", "simplified_ademamix", "madgrad",
        "madgrad_decouple_decay", "adam_l2",
        "amsgrad", "sgd_nesterov_decay", "adamw_mu_float32"])
def test_every_compiled_rule_obeys_the_law(factory: Any) -> None:
    params = every_layout(torch.float64)
    assert fast.explain(factory(), params, compile=True).fast
    conformance.check_fast_path(factory, params, grads_for(params, 1), steps=3, compile=True)


def _mixed_clip_nadam() -> functopt.GradientTransformation:
    return functopt.chain(functopt.clip_by_global_norm(0.3), functopt.nadam(1e-2))


def _mixed_adamw() -> functopt.GradientTransformation:
    return functopt.adamw(1e-2, weight_decay=0.1)


@pytest.mark.parametrize(("donate", "given"), [(False, False), (True, False), (True, True)],
                         ids=["kept", "donated", "donated-given"])
@pytest.mark.parametrize("make_inner", [
    _lion, _mixed_clip_nadam, _mixed_adamw,
    pytest.param(_late_clip, marks=_SLOW)], ids=["lion", "clip_nadam", "adamw", "late_clip"])
def test_mixed_precision_rides_the_compiled_tier(donate: bool, given: bool, make_inner: Any,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """mixed_precision(inner, compile=True): bf16 params with float32 masters laid end to end
    by init, a clip, a dynamic loss scale and an overflow step: equal to the pure mixed
    step (float32 masters to a few ulps; here the same arithmetic), params their masters
    rounded, no lost-fast-path warning. The call writes the bf16 params itself (in place
    when donated); a donating step casts the gradients into one buffer per group, or,
    with ``given`` (an accelerator's path, forced here on the CPU), the call reads the
    bf16 gradients as given and casts them itself."""
    from functopt.fast import _compiled

    monkeypatch.setattr(_compiled, "READ_GIVEN_ON_CPU", given)
    gen = torch.Generator().manual_seed(8)
    params = {"w": torch.randn(8, 4, generator=gen).bfloat16(),
              "conv": torch.randn(2, 3, 2, 2, generator=gen).bfloat16().to(
                  memory_format=torch.channels_last),
              "b": torch.randn(4, generator=gen).bfloat16()}
    inner = make_inner()
    fast_tx = functopt.precision.mixed_precision(
        inner, max_grad_norm=0.5, compile=True, donate=donate,
        loss_scale=functopt.precision.dynamic_loss_scale())
    pure_tx = functopt.precision.mixed_precision(
        inner, max_grad_norm=0.5, fused=False,
        loss_scale=functopt.precision.dynamic_loss_scale())
    p_fast = {k: v.clone() for k, v in params.items()}
    p_pure = {k: v.clone() for k, v in params.items()}
    s_fast, s_pure = fast_tx.init(p_fast), pure_tx.init(p_pure)
    masters = [s_fast.master[k] for k in params]
    assert len({m.untyped_storage().data_ptr() for m in masters}) == 1
    for i in range(4):
        grads = {k: (torch.randn(v.shape, generator=gen) * 1e3).to(v.dtype)
                 for k, v in params.items()}
        if i == 2:
            grads["b"][0] = float("inf")  # an overflow: the step is skipped
        before = dict(p_fast)
        with torch.no_grad():
            p_fast, s_fast = fast_tx.step(grads, s_fast, p_fast)
        assert all((p_fast[k] is before[k]) == donate for k in params)
        p_pure, s_pure = pure_tx.step(grads, s_pure, p_pure)
        for k in params:
            torch.testing.assert_close(s_fast.master[k], s_pure.master[k], rtol=4e-7,
                                       atol=0.0)
            assert torch.equal(p_fast[k], s_fast.master[k].to(torch.bfloat16))
    assert int(s_fast.metrics.skipped_steps) == int(s_pure.metrics.skipped_steps) == 1
    if given:  # the call reads the bf16 gradients and casts them itself: no casts kept
        assert fast_tx.buffers() == []
    elif donate:  # the float32 casts of the group's gradients: views of one buffer
        assert len({b.untyped_storage().data_ptr() for b in fast_tx.buffers()}) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_compiled_mixed_step_reads_the_bfloat16_gradients_itself() -> None:
    """Off the CPU the compiled mixed step's call reads the bf16 gradients as given (no
    float32 casts kept; ``explain`` counts 30 bytes per param for AdamW) and equals the pure
    mixed step (benchmarks/gpu_check.sh runs it)."""
    gen = torch.Generator().manual_seed(3)
    params = {k: torch.randn(64, 32, generator=gen).bfloat16().cuda() for k in ("w", "v")}
    inner = _mixed_adamw()
    fast_tx = functopt.precision.mixed_precision(inner, compile=True, donate=True)
    pure_tx = functopt.precision.mixed_precision(inner, fused=False)
    p_fast = fast_tx.lay_out({k: v.clone() for k, v in params.items()})
    p_pure = {k: v.clone() for k, v in params.items()}
    s_fast, s_pure = fast_tx.init(p_fast), pure_tx.init(p_pure)
    assert fast_tx.explain(p_fast, s_fast).bytes_per_param == 30.0
    for _ in range(3):
        grads = {k: torch.randn(v.shape, generator=gen).to(v.dtype).cuda()
                 for k, v in params.items()}
        with torch.no_grad():
            p_fast, s_fast = fast_tx.step(grads, s_fast, p_fast)
        p_pure, s_pure = pure_tx.step(grads, s_pure, p_pure)
    for k in params:
        torch.testing.assert_close(s_fast.master[k], s_pure.master[k], rtol=4e-7, atol=0.0)
        assert torch.equal(p_fast[k], s_fast.master[k].to(torch.bfloat16))
    assert fast_tx.buffers() == []


def test_each_group_compiles_its_own_code() -> None:
    """Dynamo keeps compiled graphs per code object and runs a function uncompiled past its
    recompile limit (8): every group's function has a code object of its own, so many
    groups and transforms in one process never share (and exhaust) one limit (with one
    code object shared by all of them would stop being compiled at that limit)."""
    from functopt.fast import _compiled

    first, second = _compiled._body(()), _compiled._body(())
    assert first.__code__ is not second.__code__
    assert first.__code__.co_code == second.__code__.co_code  # the same function, renamed


@pytest.mark.slow
def test_ten_transforms_in_one_process_all_compile() -> None:
    """Ten Lion configurations (ten groups) in one process: each is compiled (one graph
    each), none runs uncompiled past Dynamo's recompile limit, each equals its pure step."""
    from torch._dynamo.utils import counters

    params = every_layout(torch.float64)
    grads = grads_for(params, 9)
    before = counters["stats"]["unique_graphs"]
    for i in range(10):
        tx = functopt.lion(1e-2 * (i + 1), weight_decay=0.1)
        with torch.no_grad():
            new, _ = fast.make_step(tx, compile=True)(grads, tx.init(params), params)
        updates, _ = tx.update(grads, tx.init(params), params)
        expected = functopt.apply_updates(params, updates)
        for k in params:  # the conformance law's float64 bound
            torch.testing.assert_close(new[k], expected[k], rtol=1e-12, atol=1e-300)
    assert counters["stats"]["unique_graphs"] - before >= 10


def test_the_facade_compiles_its_groups_and_lays_the_params_out() -> None:
    """MixedPrecisionOptimizer(compile=True) with decay / no-decay groups (wd_mult) and a
    dynamic loss scale: the module's bf16 params and grads become views of one buffer per
    group, backward accumulates into them across zero_grad(), and the training run (with
    an overflow step) equals the same facade on the pure path (masters to a few float32
    ulps, params their masters rounded, the same skip)."""
    torch.manual_seed(5)

    def model() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(),
                                   torch.nn.Linear(5, 2)).to(torch.bfloat16)

    def factory(learning_rate: float = 1e-2, weight_decay: float = 0.1,
                ) -> functopt.GradientTransformation:
        return functopt.lion(learning_rate, weight_decay=weight_decay)

    def groups(m: torch.nn.Module) -> list[dict[str, Any]]:
        named = list(m.named_parameters())
        return [{"params": [(n, p) for n, p in named if p.dim() > 1]},
                {"params": [(n, p) for n, p in named if p.dim() <= 1], "wd_mult": 0.0}]

    ours, ref = model(), model()
    ref.load_state_dict(ours.state_dict())
    opts = [functopt.MixedPrecisionOptimizer(groups(m), factory, compile=c, fused=c)
            for m, c in ((ours, True), (ref, False))]
    weights = [ours[0].weight, ours[2].weight]
    assert len({w.untyped_storage().data_ptr() for w in weights}) == 1
    x = torch.randn(8, 6, dtype=torch.bfloat16)
    buffers = None
    for i in range(4):
        for m, opt in zip((ours, ref), opts, strict=True):
            opt.zero_grad()
            loss = m(x).float().square().mean() * (float("inf") if i == 2 else 1.0)
            opt.backward(loss)
        grads = [p.grad.untyped_storage().data_ptr() for p in ours.parameters()]
        assert buffers is None or grads == buffers  # accumulated into the same buffers
        buffers = grads
        took = [opt.step() for opt in opts]
        assert took[0] == took[1] == (i != 2)
    saved = [opt.named_state_dict()["state"] for opt in opts]
    for name, p in ours.named_parameters():
        master = saved[0][name]["master"]
        torch.testing.assert_close(master, saved[1][name]["master"], rtol=4e-7, atol=0.0)
        assert torch.equal(p.detach(), master.to(torch.bfloat16))


def test_kernel_rules_keep_their_kernels_when_compiling() -> None:
    """compile=True leaves Adam and SGD on PyTorch's kernels (as fast as the compiled call
    over laid-out tensors, faster than one gathering separate ones), while a mixed step
    puts them on the compiled tier, whose call also writes the low-precision params; the
    compiled tier runs what the kernels refuse: moments in another dtype than the param (a
    bfloat16 first moment of float32 params), equal to the pure path."""
    params = {"w": torch.randn(6, 5, generator=torch.Generator().manual_seed(3))}
    low = {"w": params["w"].to(torch.bfloat16)}
    for tx in (functopt.adamw(1e-2), functopt.sgd(1e-2, momentum=0.9)):
        kernels = {g.kernel for g in fast.explain(tx, params).groups}
        assert kernels and "compiled" not in kernels
        assert {g.kernel for g in fast.explain(tx, params, compile=True).groups} == kernels
        mixed = functopt.precision.mixed_precision(tx, compile=True)
        assert {g.kernel for g in mixed.explain(low).groups} == {"compiled"}
    low_mu = functopt.adamw(1e-2, mu_dtype=torch.bfloat16)
    assert not fast.explain(low_mu, params).fast  # the kernels need one dtype per leaf
    assert fast.explain(low_mu, params, compile=True).fast
    step = fast.make_step(low_mu, compile=True)
    p_fast, p_pure = clone_tree(params), clone_tree(params)
    s_fast, s_pure = step.init(p_fast), low_mu.init(p_pure)
    for i in range(3):
        grads = grads_for(params, i)
        p_fast, s_fast = step(grads, s_fast, p_fast)
        updates, s_pure = low_mu.update(grads, s_pure, p_pure)
        p_pure = functopt.apply_updates(p_pure, updates)
    assert s_fast[0].mu["w"].dtype == torch.bfloat16
    torch.testing.assert_close(p_fast["w"], p_pure["w"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(s_fast[0].mu["w"], s_pure[0].mu["w"], rtol=0, atol=0)


def test_scalars_are_computed_once_before_the_loops() -> None:
    """The tier's backend routes each computed 0-d value that a tensor with elements reads
    (Adam's bias correction here) through functopt::hoisted, which Inductor stores once
    instead of computing it for every element; a 0-d value read only by 0-d values, an
    input and an in-place write are left alone; the marked graph computes the same."""
    from functopt.fast import _compiled

    graphs: list[Any] = []

    def capture(gm: Any, example_inputs: Any) -> Any:
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    def adam_like(x: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        correction = (1 - 0.9 ** (count + 1).to(torch.float64)).to(torch.float32)
        count.add_(1)
        return x / correction

    x, count = torch.randn(5), torch.tensor(2, dtype=torch.int32)
    torch._dynamo.reset()
    torch.compile(adam_like, backend=capture, fullgraph=True)(x, count.clone())
    gm, inputs = graphs[0]
    expected = gm(*clone_tree(inputs))
    assert _compiled._hoist_scalars(gm.graph) == 1
    marked = [n for n in gm.graph.nodes if n.target is torch.ops.functopt.hoisted.default]
    assert len(marked) == 1
    (reader,) = marked[0].users
    assert reader.meta["example_value"].shape == (5,)  # the division reads the stored value
    gm.recompile()
    got = gm(*clone_tree(inputs))
    assert len(got) == len(expected) and all(map(torch.equal, got, expected))
    # and what the function computes eagerly from those inputs (the count they hold now)
    (x_in,) = [t for t in inputs if t.dim() == 1]
    (count_in,) = [t for t in inputs if t.dim() == 0]
    assert torch.equal(expected[0], adam_like(x_in.clone(), count_in.clone()))
    assert _compiled._lowering()  # Inductor lowers the mark in this torch: no warning


def test_a_clip_after_the_moments_is_a_sums_pass() -> None:
    """A clip after Adam measures Adam's updates: no kernel folds that (explain says why
    and that compile=True compiles it); the compiled tier runs it as a rule with tree
    sums, equal to the pure path, and the clip is active (the updates' norm is max_norm
    times the rate). (-m slow: the conformance law over every layout.)"""
    params = {"w": torch.randn(7, 3, generator=torch.Generator().manual_seed(5),
                               dtype=torch.float64)}
    plain = fast.explain(_late_clip(), params)
    assert not plain.fast
    assert "clip_by_global_norm after scale_by_adam has no fused form" in str(plain.reason)
    assert "make_step(tx, compile=True) compiles it" in str(plain.reason)
    got = fast.explain(_late_clip(), params, compile=True)
    assert got.fast and got.clips == 0 and got.tree_sums == 1
    assert got.groups[0].rules[:2] == ("scale_by_adam", "clip_by_global_norm")
    # the per-leaf tier runs a rule with tree sums (Prodigy) as its own update: no sums pass
    perleaf = fast.explain(functopt.chain(functopt.clip_by_block_rms(1.0),
                                          functopt.contrib.prodigy()), params)
    assert perleaf.fast and perleaf.tree_sums == 0 and "sums pass" not in str(perleaf)
    tx = functopt.chain(functopt.scale_by_adam(), functopt.clip_by_global_norm(0.05),
                        functopt.scale_by_learning_rate(1e-2))
    step = fast.make_step(tx, compile=True)
    state, pure_state = step.init(params), tx.init(params)
    now, pure = params, params
    for i in range(2):
        grads = grads_for(params, i)
        new, state = step(grads, state, now)
        moved = functopt.tree.global_norm({"w": new["w"] - now["w"]})
        assert float(moved) == pytest.approx(0.05 * 1e-2, rel=1e-12)
        updates, pure_state = tx.update(grads, pure_state, pure)
        now, pure = new, functopt.apply_updates(pure, updates)
        torch.testing.assert_close(now["w"], pure["w"], rtol=1e-12, atol=0.0)
        torch.testing.assert_close(state[0].nu["w"], pure_state[0].nu["w"], rtol=1e-12,
                                   atol=0.0)


def test_a_lost_inductor_lowering_warns_once_and_hoists_nothing(monkeypatch) -> None:
    """Inductor's lowering registry is private API: if registering the mark fails, the
    tier says so once (FastPathWarning), and compiles without hoisting."""
    from torch._inductor import lowering

    from functopt.fast import _compiled

    def moved(*args: Any, **kwargs: Any) -> Any:
        raise AttributeError("register_lowering moved")

    monkeypatch.setattr(_compiled, "_LOWERED", [])
    monkeypatch.setattr(lowering, "register_lowering", moved)
    with pytest.warns(fast.FastPathWarning, match="cannot register its Inductor lowering"):
        assert not _compiled._lowering()
    assert not _compiled._lowering()  # decided once: no second warning (warnings are errors)
