"""The research optimizers of ``functopt.contrib`` on the planner's compiled tier
(``make_step(tx, compile=True)``): schedule-free (its base optimizer's rules, then the
averaging) and Prodigy / D-Adaptation (elementwise rules with tree-wide sums inside), held
to the pure path, and the cases the planner refuses said by name.

Each compiled structure costs seconds here, so the default run compiles two steps (one per
mechanism) and shares each across its asserts; ``-m slow`` runs the conformance law
(``check_fast_path(compile=True)``) on all four recipes in float64 and float32, two dtype
groups, a leading clip and ``apply_if_finite``.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from compiled_cases import every_layout, grads_for

import functopt
from functopt import contrib, fast
from functopt.testing import assert_bitwise_equal, clone_tree, conformance
from functopt.tree import _core

# Importing Inductor on the CPU defines torch.utils.mkldnn's ScriptModules, which warn.
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def _compiled_run_equals_pure(tx: functopt.GradientTransformation, steps: int,
                              params: dict[str, torch.Tensor]) -> Any:
    """``steps`` donated compiled steps from ``step.init`` against the pure path from
    ``tx.init`` on the same params, compared leaf by leaf after every step (float64 to
    1e-12, float32 to 4 ulps); returns the last compiled state. One gradient throughout:
    the params move along it, so Prodigy's <g, x0 - x> turns positive from the second
    step."""
    layouts = {k: v.stride() for k, v in params.items()}
    explained = fast.explain(tx, params, compile=True)
    assert explained.fast and {g.kernel for g in explained.groups} == {"compiled"}
    step = fast.make_step(tx, compile=True, donate=True)
    state = step.init(params)
    pure_params, pure_state = clone_tree(params), tx.init(params)
    grads = grads_for(params, 0)
    for k in range(steps):
        with torch.no_grad():
            params, state = step(grads, state, params)
        updates, pure_state = tx.update(grads, pure_state, pure_params)
        pure_params = functopt.apply_updates(pure_params, updates)
        for name, got, want in ((f"step {k}, params", params, pure_params),
                                (f"step {k}, state", state, pure_state)):
            for a, b in zip(_core.flatten(got)[0], _core.flatten(want)[0], strict=True):
                assert a.shape == b.shape and a.dtype == b.dtype, name
                tol = 1e-12 if a.dtype != torch.float32 else 4 * torch.finfo(a.dtype).eps
                torch.testing.assert_close(a, b, rtol=tol, atol=1e-12, msg=name)
    # the params kept their layouts (written in place, donated)
    for k, p in params.items():
        assert p.stride() == layouts[k] or p.numel() <= 1
    return state


def test_schedule_free_adamw_compiles_and_equals_the_pure_path() -> None:
    """The base optimizer's rules (RMS, decay, a warmup schedule) and the averaging in one
    compiled call per group: params, z, the base moments and the scalar state (weight sum,
    largest lr, step count) equal the pure path's over four steps, every layout."""
    tx = contrib.schedule_free_adamw(0.1, warmup_steps=2, weight_decay=0.01)
    explained = fast.explain(tx, every_layout(torch.float64), compile=True)
    assert explained.groups[0].rules == (
        "scale_by_rms", "add_decayed_weights", "scale_by_learning_rate", "schedule_free")
    state = _compiled_run_equals_pure(tx, 4, every_layout(torch.float64))
    assert int(state.step_count) == 5  # moved by the compiled call itself, once per step
    assert float(state.weight_sum) > 0


def test_prodigy_sums_over_two_dtype_groups() -> None:
    """Leaves of two dtypes are two compiled groups: a sums pass per group, the sums added,
    then each group's step with them. Every moment, the distance estimate and the params
    follow the pure path (whose sums run over every leaf) over three steps."""
    params = dict(every_layout(torch.float64), h=torch.randn(2, 3), h0=torch.randn(()))
    tx = contrib.prodigy(weight_decay=0.1)
    assert len(fast.explain(tx, params, compile=True).groups) == 2
    state = _compiled_run_equals_pure(tx, 3, params)
    # the inner product fed the state (0 at the first step, where x = x0), equal as above
    assert float(state.numerator_weighted) > 0


def test_one_rule_with_tree_sums_per_program() -> None:
    """A second rule with tree sums after the first would sum the first's output, which
    needs the first's sums: the planner says it keeps the pure path."""
    tx = functopt.chain(contrib.prodigy(), contrib.dadapt_adamw())
    reason = str(fast.explain(tx, {"w": torch.zeros(2)}, compile=True).reason)
    assert "one rule with tree sums per program, not prodigy and dadapt_adamw" in reason


def test_without_compile_the_hint_names_the_compiled_tier() -> None:
    params = every_layout(torch.float32)
    for tx in (contrib.schedule_free_sgd(0.1), contrib.dadapt_adamw()):
        explained = fast.explain(tx, params)
        assert not explained.fast
        assert "make_step(tx, compile=True) compiles it" in str(explained.reason)
        assert fast.explain(tx, params, compile=True).fast


def test_schedule_free_spec_follows_its_base() -> None:
    """The spec is the base's rules then the averaging: a base the compiled tier cannot
    lower (an opaque one) keeps the whole transform pure, naming where."""
    opaque = functopt.GradientTransformation(lambda p: (), lambda u, s, p=None: (u, s))
    reason = str(fast.explain(contrib.schedule_free(opaque, 0.1), {"w": torch.zeros(2)},
                              compile=True).reason)
    assert "schedule_free['base_optimizer']" in reason and "without a spec" in reason
    plain = contrib.schedule_free(functopt.adam(0.1, b1=0.0), 0.1)
    assert fast.explain(plain, {"w": torch.zeros(2)}, compile=True).fast


# --- the conformance law on every recipe (slow: each structure compiles) -----------------

_RECIPES = {
    "schedule_free_adamw": lambda: contrib.schedule_free_adamw(
        0.1, warmup_steps=2, weight_decay=0.01),
    "schedule_free_sgd": lambda: contrib.schedule_free_sgd(
        0.1, weight_decay=0.01, state_dtype=torch.float32),
    "prodigy": lambda: contrib.prodigy(weight_decay=0.1),
    "prodigy[safeguard]": lambda: contrib.prodigy(safeguard_warmup=True, beta3=0.9),
    "dadapt_adamw": lambda: contrib.dadapt_adamw(weight_decay=0.1),
    # the options that reproduce the authors' packages (tests/test_contrib_ports.py)
    "prodigy[no bias correction]": lambda: contrib.prodigy(bias_correction=False),
    "dadapt_adamw[no bias correction]": lambda: contrib.dadapt_adamw(
        weight_decay=0.1, bias_correction=False),
    "schedule_free_adamw[warmup from lr/W]": lambda: contrib.schedule_free_adamw(
        0.1, warmup_steps=2, weight_decay=0.01, warmup_from_zero=False),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_RECIPES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_compiled_recipes_obey_the_fast_path_law(name: str, dtype: torch.dtype) -> None:
    """float64 to 1e-12, float32 to a few ulps per step; donated or not, with the state
    as tx.init and as step.init lay it out."""
    params = every_layout(dtype)
    assert fast.explain(_RECIPES[name](), params, compile=True).fast
    conformance.check_fast_path(_RECIPES[name], params, grads_for(params, 1), steps=3,
                                compile=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["schedule_free_adamw", "prodigy[safeguard]", "dadapt_adamw"])
def test_two_dtype_groups(name: str) -> None:
    """Two groups each move the shared scalar state from the same old values (and, for
    the rules with tree sums, with the sums over both groups): the pure path's result."""
    params = dict(every_layout(torch.float64), h=torch.randn(2, 3), h0=torch.randn(()))
    assert len(fast.explain(_RECIPES[name](), params, compile=True).groups) == 2
    conformance.check_fast_path(_RECIPES[name], params, grads_for(params, 2), steps=3,
                                compile=True)


@pytest.mark.slow
@pytest.mark.parametrize("inner", ["schedule_free_sgd", "prodigy"])
def test_guarded_and_clipped_recipes(inner: str) -> None:
    """A leading clip scales the gradients the rules (and Prodigy's sums) see; a
    non-finite gradient skips the step whole, in the compiled call."""
    def factory() -> functopt.GradientTransformation:
        return functopt.apply_if_finite(functopt.chain(
            functopt.clip_by_global_norm(0.5), _RECIPES[inner]()), max_consecutive_errors=2)

    params = every_layout(torch.float64)
    grads = grads_for(params, 3)
    conformance.check_fast_path(factory, params, grads, steps=2, compile=True)
    bad = clone_tree(grads)
    bad["b"][1] = float("nan")
    tx = factory()
    step = fast.make_step(tx, compile=True, donate=True)
    state = step.init(params)
    kept, kept_state = clone_tree(params), clone_tree(state)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        new, new_state = step(bad, state, params)
    assert_bitwise_equal(new, kept)
    assert_bitwise_equal(new_state.inner_state, kept_state.inner_state)
    assert int(new_state.notfinite_count) == 1


@pytest.mark.slow
def test_mixed_precision_prodigy_is_one_group_of_masters() -> None:
    """bf16 params with float32 masters and a float32 param: one group, so Prodigy compiles inside
    mixed_precision(..., compile=True) and its masters follow the pure mixed step to
    float32 rounding, the params their masters rounded."""
    gen = torch.Generator().manual_seed(8)
    params = {"w": torch.randn(8, 4, generator=gen).bfloat16(),
              "conv": torch.randn(2, 3, 2, 2, generator=gen).bfloat16().to(
                  memory_format=torch.channels_last),
              "b": torch.randn(4, generator=gen)}
    inner = contrib.prodigy(weight_decay=0.1)
    fast_tx = functopt.precision.mixed_precision(inner, max_grad_norm=1.0, compile=True)
    pure_tx = functopt.precision.mixed_precision(inner, max_grad_norm=1.0, fused=False)
    p_fast, p_pure = clone_tree(params), clone_tree(params)
    s_fast, s_pure = fast_tx.init(p_fast), pure_tx.init(p_pure)
    grads = {k: torch.randn(v.shape, generator=gen).to(v.dtype) for k, v in params.items()}
    for _ in range(4):
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error", fast.FastPathWarning)
            p_fast, s_fast = fast_tx.step(grads, s_fast, p_fast)
        p_pure, s_pure = pure_tx.step(grads, s_pure, p_pure)
        for k in ("w", "conv"):
            torch.testing.assert_close(s_fast.master[k], s_pure.master[k], rtol=1e-6,
                                       atol=0.0)
            assert torch.equal(p_fast[k], s_fast.master[k].to(torch.bfloat16))
        assert s_fast.master["b"] is None  # a float32 param is its own master
        torch.testing.assert_close(p_fast["b"], p_pure["b"], rtol=1e-6, atol=0.0)
    assert float(s_fast.inner_state.numerator_weighted) > 0


# --- DTensor params (2 gloo ranks, slow: each rank compiles) -----------------------------

@pytest.fixture(scope="module")
def sharded_results() -> list[dict[str, str | None]]:
    from distributed import contrib_fast_checks, harness

    return harness.run_ranks(contrib_fast_checks.run_all, 2, timeout_s=300.0)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["schedule_free_compiles_on_shards_without_collectives",
                                  "prodigy_on_shards_one_all_reduce_per_step",
                                  # not contrib: the same lowering for a clip after Adam
                                  "late_clip_on_shards_one_all_reduce_per_step",
                                  "late_guard_on_shards_one_all_reduce_per_step",
                                  "clip_prodigy_on_shards_two_all_reduces_per_step",
                                  "guarded_prodigy_on_shards_one_all_reduce_per_step",
                                  "mixed_compiled_prodigy_on_shards_one_all_reduce_per_step",
                                  "mixed_multisteps_prodigy_on_shards_one_all_reduce_per_step",
                                  "clip_adamw_compiled_on_shards_one_all_reduce_per_step",
                                  "prodigy_on_a_rank_holding_nothing"])
def test_on_dtensor_shards(sharded_results: list[dict[str, str | None]], name: str) -> None:
    failures = [f"rank {rank}:\n{r[name]}" for rank, r in enumerate(sharded_results)
                if r[name]]
    assert not failures, "\n".join(failures)
