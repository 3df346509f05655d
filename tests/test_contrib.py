"""functopt.contrib: float64 parity with optax.contrib, the conformance laws, properties and
errors.

The reference values come from optax 0.2.8 itself (tests/golden/contrib_optax.json, made by
hand with tests/golden/make_contrib_golden.py): 24 configurations, 20 steps each, on a tree
with a non-square matrix, a 3-D weight (Muon's dimension numbers), a vector and a 0-d leaf.
"""

from __future__ import annotations

import inspect
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functopt
from functopt import contrib
from functopt.testing import assert_bitwise_equal, conformance
from functopt.testing import strategies as fst

GOLDEN = json.loads((Path(__file__).parent / "golden" / "contrib_optax.json").read_text())
F64 = torch.float64

# Largest relative error (max |ours - optax| / max |optax| over a step's updates) allowed.
# Everything is float64; the only differences are the order of floating-point operations
# (XLA's matmuls and reductions against torch's), which 20 steps amplify a little.
RTOL = 1e-10


def _tensor(value: Any) -> torch.Tensor:
    return torch.tensor(value, dtype=F64)


def _build(name: str, value: Any) -> Any:
    if isinstance(value, dict) and "schedule" in value:
        kwargs = {k: v for k, v in value.items() if k != "schedule"}
        return getattr(functopt.schedules, value["schedule"])(**kwargs)
    if name in ("muon_weight_dimension_numbers", "weight_dimension_numbers"):
        return {k: None if v is None else eval(v, {"DN": contrib.MuonDimensionNumbers})
                for k, v in value.items()}
    if name == "base_optimizer":
        spec = dict(value)
        return getattr(functopt, spec.pop("optimizer"))(**spec)
    if name == "betas":
        return tuple(value)
    if name == "ns_coeffs" and isinstance(value, list):
        return tuple(tuple(row) for row in value)
    return value


def _factory(config: dict[str, Any]) -> Any:
    kwargs = {k: _build(k, v) for k, v in config["kwargs"].items()}
    return getattr(contrib, config["factory"])(**kwargs)


def run_config(config: dict[str, Any]) -> tuple[float, float]:
    """Run one golden configuration; the worst relative errors of updates and eval params."""
    keys = config["keys"]
    params = {k: _tensor(GOLDEN["params0"][k]) for k in keys}
    tx = _factory(config)
    state = tx.init(params)
    worst, worst_eval = 0.0, 0.0
    for t in range(GOLDEN["steps"]):
        grads = {k: _tensor(GOLDEN["grads"][t][k]) for k in keys}
        updates, state = tx.update(grads, state, params)
        expected = {k: _tensor(config["updates"][t][k]) for k in keys}
        for k in keys:
            assert updates[k].dtype == F64 and updates[k].shape == expected[k].shape
            scale = float(expected[k].abs().max()) or 1.0
            worst = max(worst, float((updates[k] - expected[k]).abs().max()) / scale)
        # optax applies p + u in float64, as apply_updates does here.
        params = functopt.apply_updates(params, updates)
        if "eval_params" in config:
            x = contrib.schedule_free_eval_params(state, params)
            for k in keys:
                ref = _tensor(config["eval_params"][t][k])
                scale = float(ref.abs().max()) or 1.0
                worst_eval = max(worst_eval, float((x[k] - ref).abs().max()) / scale)
    return worst, worst_eval


# optax's MADGRAD computes its weight (lr + eps) * sqrt(count + 1) in float32 even in float64
# runs (jnp.sqrt of an int32 count gives float32, and a Python float times it stays float32),
# a relative error of up to 6e-8 in each step's weight; functopt computes it in float64. test_madgrad_matches_a_float64_reference_and_optax_to_its_float32_weight
# holds functopt to a MADGRAD written out here in float64 to 1e-10, and to optax to 1e-5.
MADGRAD = {"madgrad_default", "madgrad_options", "scale_by_madgrad"}


@pytest.mark.parametrize("name", sorted(set(GOLDEN["configs"]) - MADGRAD))
def test_float64_parity_with_optax_contrib(name: str) -> None:
    worst, worst_eval = run_config(GOLDEN["configs"][name])
    print(f"{name}: max relative error over 20 steps {worst:.2e} (eval params {worst_eval:.2e})")
    assert worst < RTOL, f"{name}: {worst:.3e}"
    assert worst_eval < RTOL, f"{name}: eval params {worst_eval:.3e}"


def test_golden_file_records_its_source() -> None:
    assert GOLDEN["optax_version"] == "0.2.8"
    assert len(GOLDEN["configs"]) >= 20
    # Each optimizer of the issue has at least one configuration (and the parity tests run
    # every one of them).
    factories = {c["factory"] for c in GOLDEN["configs"].values()}
    assert {"muon", "scale_by_muon", "schedule_free", "schedule_free_adamw",
            "schedule_free_sgd", "adopt", "ademamix", "scale_by_ademamix",
            "simplified_ademamix", "prodigy", "dadapt_adamw", "madgrad",
            "scale_by_madgrad"} <= factories


def _defaults(fn: Any) -> list[tuple[str, Any]]:
    out = []
    for p in inspect.signature(fn).parameters.values():
        default = None if p.default is inspect.Parameter.empty else p.default
        if isinstance(default, tuple):
            default = list(default)
        out.append((p.name, p.kind.name, default))
    return out


# functopt's own options, keyword-only and after optax's, whose default is optax's behaviour
# (the ones that reproduce the authors' packages: tests/test_contrib_ports.py)
EXTRA_OPTIONS: dict[str, dict[str, Any]] = {
    "muon": {"ns_dtype": None},
    "scale_by_muon": {"ns_dtype": None, "bias_correction": True, "clamp_norm": False},
    "prodigy": {"bias_correction": True}, "dadapt_adamw": {"bias_correction": True},
    "schedule_free_sgd": {"warmup_from_zero": True},
    "schedule_free_adamw": {"warmup_from_zero": True},
    "madgrad": {"decouple_decay": False},
}


@pytest.mark.parametrize("name", sorted(GOLDEN["signatures"]))
def test_signature_matches_optax(name: str) -> None:
    ours = _defaults(getattr(contrib, name))
    extras = EXTRA_OPTIONS.get(name, {})
    assert [x for x in ours if x[0] in extras] == [
        (x, "KEYWORD_ONLY", default) for x, default in extras.items()]
    assert [x[0] for x in ours[len(ours) - len(extras):]] == list(extras)
    ours = ours[:len(ours) - len(extras)]
    theirs = [tuple(x) for x in GOLDEN["signatures"][name]]
    assert [x[:2] for x in ours] == [x[:2] for x in theirs], name
    for (pname, _, mine), (_, _, ref) in zip(ours, theirs, strict=True):
        if isinstance(ref, str) and ref.startswith("<function"):
            continue  # a default function (adopt's clip_value_fn): checked by behaviour
        if isinstance(mine, list) and mine and isinstance(mine[0], tuple):
            mine = [list(row) for row in mine]
        assert mine == ref, f"{name}.{pname}: default {mine!r}, optax {ref!r}"


def _madgrad_reference(config: dict[str, Any]) -> list[dict[str, Any]]:
    """MADGRAD written out from the paper (Defazio & Jelassi, Algorithm 1, with optax's
    coupled weight decay and schedule conventions) in float64 Python arithmetic."""
    kw = {k: _build(k, v) for k, v in config["kwargs"].items()}
    lr, momentum = kw["learning_rate"], kw.get("momentum", 0.9)
    eps, decay = kw.get("eps", 1e-6), kw.get("weight_decay", 0.0)
    keys = config["keys"]
    x = {k: _tensor(GOLDEN["params0"][k]) for k in keys}
    x0 = {k: v.clone() for k, v in x.items()}
    v = {k: torch.zeros_like(t) for k, t in x.items()}
    s = {k: torch.zeros_like(t) for k, t in x.items()}
    out = []
    for k_step in range(GOLDEN["steps"]):
        eta = float(lr(k_step)) if callable(lr) else lr
        lamb = (eta + eps) * (k_step + 1) ** 0.5
        step = {}
        for k in keys:
            g = _tensor(GOLDEN["grads"][k_step][k]) + decay * x[k]
            v[k] = v[k] + lamb * g * g
            s[k] = s[k] + lamb * g
            z = x0[k] - s[k] / (v[k].pow(1 / 3) + eps)
            step[k] = (1 - momentum) * z + momentum * x[k] - x[k]
        x = {k: x[k] + step[k] for k in keys}
        out.append(step)
    return out


@pytest.mark.parametrize("name", sorted(MADGRAD))
def test_madgrad_matches_a_float64_reference_and_optax_to_its_float32_weight(name: str) -> None:
    config = GOLDEN["configs"][name]
    exact = _madgrad_reference(config)
    keys = config["keys"]
    params = {k: _tensor(GOLDEN["params0"][k]) for k in keys}
    tx = _factory(config)
    state = tx.init(params)
    worst_ours, worst_optax = 0.0, 0.0
    for t in range(GOLDEN["steps"]):
        grads = {k: _tensor(GOLDEN["grads"][t][k]) for k in keys}
        updates, state = tx.update(grads, state, params)
        params = functopt.apply_updates(params, updates)
        for k in keys:
            golden = _tensor(config["updates"][t][k])
            scale = float(golden.abs().max())
            worst_ours = max(worst_ours, float((updates[k] - exact[t][k]).abs().max()) / scale)
            worst_optax = max(worst_optax, float((updates[k] - golden).abs().max()) / scale)
    print(f"{name}: ours vs the float64 reference {worst_ours:.2e}; ours vs optax "
          f"{worst_optax:.2e}")
    assert worst_ours < RTOL  # functopt is the paper's rule, computed in float64
    assert worst_optax < 1e-5  # what the float32 root amounts to over 20 steps


# --- the conformance laws, on drawn trees of every dtype ----------------------------------


def _matrices(tree: Any) -> Any:
    leaves, spec = functopt.tree._core.flatten(tree)
    return functopt.tree._core.unflatten(
        spec, [x is not None and x.dim() == 2 for x in leaves])


C = contrib
ENTRIES: list[tuple[str, str, Any]] = [
    ("muon", "muon", lambda: C.muon(0.02)),
    ("muon[plain,adaptive,spectral,rms,decay]", "muon",
     lambda: C.muon(0.02, nesterov=False, adaptive=True, preconditioning="spectral",
                    consistent_rms=0.2, weight_decay=0.1, adam_weight_decay=0.1)),
    ("muon[aol,dion,bf16-mu]", "muon",
     lambda: C.muon(0.02, ns_coeffs="dion", preconditioning="aol", mu_dtype=torch.bfloat16)),
    ("scale_by_muon[masked to matrices]", "scale_by_muon",
     lambda: functopt.masked(C.scale_by_muon(preconditioning="schatten"), _matrices)),
    ("schedule_free", "schedule_free",
     lambda: C.schedule_free(functopt.adam(0.1, b1=0.0), 0.1)),
    ("schedule_free_adamw", "schedule_free_adamw",
     lambda: C.schedule_free_adamw(0.1, warmup_steps=2, weight_decay=0.01)),
    ("schedule_free_sgd", "schedule_free_sgd",
     lambda: C.schedule_free_sgd(0.1, weight_decay=0.01, state_dtype=torch.float32)),
    ("adopt", "adopt", lambda: C.adopt(1e-2)),
    ("scale_by_adopt[nesterov]", "scale_by_adopt", lambda: C.scale_by_adopt(nesterov=True)),
    ("ademamix", "ademamix", lambda: C.ademamix(1e-2, weight_decay=0.1)),
    ("scale_by_ademamix", "scale_by_ademamix", lambda: C.scale_by_ademamix()),
    ("simplified_ademamix", "simplified_ademamix", lambda: C.simplified_ademamix(1e-2)),
    ("scale_by_simplified_ademamix", "scale_by_simplified_ademamix",
     lambda: C.scale_by_simplified_ademamix(alpha=1.0)),
    ("prodigy", "prodigy", lambda: C.prodigy()),
    ("prodigy[safeguard]", "prodigy", lambda: C.prodigy(safeguard_warmup=True, weight_decay=0.1)),
    ("prodigy[no bias correction]", "prodigy", lambda: C.prodigy(bias_correction=False)),
    ("dadapt_adamw", "dadapt_adamw", lambda: C.dadapt_adamw(weight_decay=0.1)),
    ("dadapt_adamw[no bias correction]", "dadapt_adamw",
     lambda: C.dadapt_adamw(weight_decay=0.1, bias_correction=False)),
    ("schedule_free_sgd[warmup from lr/W]", "schedule_free_sgd",
     lambda: C.schedule_free_sgd(0.1, warmup_steps=3, warmup_from_zero=False)),
    ("madgrad", "madgrad", lambda: C.madgrad(1e-2, weight_decay=0.1)),
    ("madgrad[decouple_decay]", "madgrad",
     lambda: C.madgrad(1e-2, weight_decay=0.1, decouple_decay=True)),
    ("scale_by_madgrad", "scale_by_madgrad", lambda: C.scale_by_madgrad(1e-2)),
]


def test_every_contrib_factory_is_in_the_conformance_suite() -> None:
    factories = {n for n in contrib.__all__
                 if callable(getattr(contrib, n)) and n[0].islower()
                 and n != "schedule_free_eval_params"}
    assert factories == {e[1] for e in ENTRIES}


@pytest.mark.parametrize("grad_kind", ["finite", "any"])
@pytest.mark.parametrize("entry", ENTRIES, ids=[e[0] for e in ENTRIES])
@settings(max_examples=4, deadline=None)
@given(data=st.data())
def test_contrib_conforms(entry: tuple[str, str, Any], grad_kind: Any,
                          data: st.DataObject) -> None:
    params, grads, mask = data.draw(conformance.cases(grad_kind=grad_kind, max_leaves=4))
    conformance.check_transform(entry[2], params, grads, mask=mask)


@pytest.mark.parametrize("entry", ENTRIES, ids=[e[0] for e in ENTRIES])
@settings(max_examples=4, deadline=None)
@given(data=st.data())
def test_fast_step_equals_pure_step(entry: tuple[str, str, Any], data: st.DataObject) -> None:
    # The fast-path law: make_step (grouped foreach apply for these chains) is bitwise the
    # pure update followed by apply_updates, and donation changes nothing but where it writes.
    # These rules have no PyTorch kernel, and a step with a gradient to apply says so (the
    # elementwise ones compile with make_step(tx, compile=True): tests/test_compiled.py).
    # Muon takes the planner's per-leaf tier (tests/test_perleaf_fast.py): no warning, and
    # the conformance law (test_contrib_conforms) holds it to the pure step.
    params, grads, _ = data.draw(conformance.cases(grad_kind="finite", max_leaves=4))
    tx = entry[2]()
    state = tx.init(params)
    updates, pure_state = tx.update(grads, state, params)
    pure_params = functopt.apply_updates(params, updates)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fast_params, fast_state = functopt.fast.make_step(tx)(grads, state, params)
    lost = any(issubclass(w.category, functopt.fast.FastPathWarning) for w in caught)
    if functopt.fast.explain(tx, params, state, grads).fast:
        assert not lost
        return
    if any(g is not None for g in functopt.tree.flatten(grads)[0]):
        assert lost
    assert_same = assert_bitwise_equal
    assert_same(fast_params, pure_params)
    assert_same(fast_state, pure_state)


# --- properties of the maths ---------------------------------------------------------------

matrix_shapes = st.tuples(st.integers(1, 6), st.integers(1, 6))


@settings(max_examples=25, deadline=None)
@given(shape=matrix_shapes, seed=st.integers(0, 2**16), transposed=st.booleans())
def test_newton_schulz_pushes_singular_values_into_muons_band(
        shape: tuple[int, int], seed: int, transposed: bool) -> None:
    # Muon's quintic does not converge to 1: optax documents singular values in about
    # (0.5, 1.5) after five steps for a full-rank input; the singular vectors are those of
    # the input (the iteration is an odd polynomial of it).
    g = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)
    if transposed:
        g = g.T.contiguous()
    tx = contrib.scale_by_muon(nesterov=False)
    u, _ = tx.update({"w": g}, tx.init({"w": g}))
    s = torch.linalg.svdvals(u["w"])
    sg = torch.linalg.svdvals(g)
    full = sg > 1e-3 * sg.max()
    assert bool((s[full] > 0.3).all() and (s < 1.25).all()), (s, sg)
    # The update commutes with the input's polar factor: U^T u V is diagonal.
    uu, _, vh = torch.linalg.svd(g, full_matrices=False)
    core = uu.T @ u["w"] @ vh.T
    off = core - torch.diag(torch.diagonal(core))
    assert float(off.abs().max()) < 1e-8


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), reduction=st.sampled_from([0, 1, 2]))
def test_muon_dimension_numbers_batch_the_other_axes(seed: int, reduction: int) -> None:
    # A 3-D weight with one batch axis is orthogonalised slice by slice, as 2-D matrices.
    g = torch.randn(3, 4, 2, generator=torch.Generator().manual_seed(seed), dtype=F64)
    output = (reduction + 1) % 3
    batch = 3 - reduction - output
    dims = contrib.MuonDimensionNumbers(reduction_axis=reduction, output_axis=output)
    tx = contrib.scale_by_muon(weight_dimension_numbers={"k": dims})
    u, _ = tx.update({"k": g}, tx.init({"k": g}))
    two_d = contrib.scale_by_muon()
    for i in range(g.shape[batch]):
        matrix = g.select(batch, i)
        if reduction > output:  # select keeps the axis order: put reduction first
            matrix = matrix.T
        expected, _ = two_d.update({"w": matrix}, two_d.init({"w": matrix}))
        got = u["k"].select(batch, i)
        got = got.T if reduction > output else got
        torch.testing.assert_close(got, expected["w"], rtol=1e-12, atol=1e-14)


def _newton_schulz_transcribed(m: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # Muon's iteration written out from the paper, every operation in ``dtype``: divide by
    # the Frobenius norm (+ eps), then five quintic steps on the side with the smaller Gram
    # matrix, each step's two products taken with their multiply-adds fused (one rounding
    # per product, as torch.optim.Muon computes it)
    a, b, c = 3.4445, -4.7750, 2.0315
    x = m.to(dtype)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (torch.linalg.matrix_norm(x) + torch.tensor(1e-8, dtype=dtype))
    for _ in range(5):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


@pytest.mark.parametrize("shape", [(64, 64), (48, 96), (96, 40)])
def test_bfloat16_newton_schulz_is_the_iteration_in_bfloat16(shape: tuple[int, int]) -> None:
    # ns_dtype=torch.bfloat16 runs the normalisation and the iteration in bfloat16 (the
    # momentum stays float32): within bfloat16 rounding of the iteration transcribed in
    # bfloat16, and far from the float32 iteration's update only by that rounding. Without
    # ns_dtype (or with float32) the update is the float32 iteration, as before.
    g = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    params = {"w": torch.zeros(shape)}
    updates = {}
    for key, ns_dtype in (("default", None), ("float32", torch.float32),
                          ("bfloat16", torch.bfloat16)):
        tx = contrib.scale_by_muon(nesterov=False, ns_dtype=ns_dtype)
        updates[key] = tx.update({"w": g}, tx.init(params))[0]["w"]
    # (no Nesterov, first step: the bias-corrected momentum is g itself)
    want16 = _newton_schulz_transcribed(g, torch.bfloat16).float()
    want32 = _newton_schulz_transcribed(g, torch.float32)
    assert updates["bfloat16"].dtype == torch.float32  # the update keeps the grad's dtype
    bf16_eps = torch.finfo(torch.bfloat16).eps
    scale = float(want16.abs().max())
    assert float((updates["bfloat16"] - want16).abs().max()) <= 4 * bf16_eps * scale
    # bfloat16's rounding shows: not the float32 update to float32 precision
    assert float((updates["bfloat16"] - want32).abs().max()) > 100 * torch.finfo(
        torch.float32).eps * scale
    torch.testing.assert_close(updates["default"], want32, rtol=1e-5, atol=1e-6)
    assert_bitwise_equal(updates["float32"], updates["default"])


def test_muon_recipe_passes_ns_dtype_on_and_refuses_a_non_float() -> None:
    params = {"w": torch.randn(32, 16), "b": torch.zeros(16)}
    grads = {"w": torch.randn(32, 16), "b": torch.ones(16)}
    opt16, inner = contrib.muon(0.1, ns_dtype=torch.bfloat16), contrib.scale_by_muon(
        ns_dtype=torch.bfloat16)
    got = opt16.update(grads, opt16.init(params), params)[0]["w"]
    want = inner.update({"w": grads["w"]}, inner.init({"w": params["w"]}))[0]["w"]
    assert_bitwise_equal(got, -0.1 * want)  # shape factor sqrt(max(1, 16/32)) = 1
    with pytest.raises(TypeError, match=r"scale_by_muon: ns_dtype must be None or a floating "
                                        r"torch.dtype .* got torch.int32"):
        contrib.muon(0.1, ns_dtype=torch.int32)


def test_the_documented_torch_layout_one_liner() -> None:
    # what muon's docstring gives torch users: nn.Linear weights read as (out, in), the
    # embedding and the head sent to AdamW
    model = torch.nn.ModuleDict({"embed": torch.nn.Embedding(10, 8),
                                 "fc": torch.nn.Linear(8, 24), "lm_head": torch.nn.Linear(8, 10)})
    params = {k: v.detach().double() for k, v in model.named_parameters()}
    dims = lambda p: {k: contrib.MuonDimensionNumbers(1, 0) if v is not None and  # noqa: E731
                      v.dim() == 2 and not k.startswith(("embed", "lm_head")) else None
                      for k, v in p.items()}
    opt = contrib.muon(0.1, muon_weight_dimension_numbers=dims)
    grads = {k: torch.randn(v.shape, dtype=F64) for k, v in params.items()}
    updates, _ = opt.update(grads, opt.init(params), params)
    adam = functopt.adamw(0.1, weight_decay=0.0, nesterov=True)
    for k in ("embed.weight", "lm_head.weight", "fc.bias"):
        expected, _ = adam.update({k: grads[k]}, adam.init({k: params[k]}), {k: params[k]})
        torch.testing.assert_close(updates[k], expected[k], rtol=1e-14, atol=0)
    # fc.weight is (out=24, in=8): the shape factor is sqrt(max(1, 24/8)), Keller Jordan's
    # sqrt(max(1, rows/cols)) for a torch weight; optax's default reading would give 1
    ortho = contrib.scale_by_muon()
    u, _ = ortho.update({"w": grads["fc.weight"]}, ortho.init({"w": params["fc.weight"]}))
    torch.testing.assert_close(updates["fc.weight"], -0.1 * 3 ** 0.5 * u["w"], rtol=1e-14,
                               atol=0)


@pytest.mark.parametrize("entry", ENTRIES, ids=[e[0] for e in ENTRIES])
def test_none_gradient_leaves_its_state_and_param_alone(entry: tuple[str, str, Any]) -> None:
    params = {"w": torch.randn(3, 2, dtype=F64), "b": torch.randn(2, dtype=F64)}
    tx = entry[2]()
    state = tx.init(params)
    _, state = tx.update({"w": torch.ones(3, 2, dtype=F64), "b": torch.ones(2, dtype=F64)},
                         state, params)
    updates, new_state = tx.update({"w": torch.ones(3, 2, dtype=F64), "b": None}, state, params)
    assert updates["b"] is None
    # Every per-leaf state entry of "b" is bitwise what it was.
    before = [v for path, v in functopt.tree.leaves_with_path(state) if "b" in path.split(".")]
    after = [v for path, v in functopt.tree.leaves_with_path(new_state)
             if "b" in path.split(".")]
    assert before and len(before) == len(after)
    for x, y in zip(before, after, strict=True):
        assert x is y or torch.equal(x, y)


# Prodigy's second moment is of (d g)^2 with d from 1e-6: 1e-12 underflows a float16 state to
# zero (documented in prodigy's docstring; the same holds in optax), so it is left out there.
LOW_PRECISION = [pytest.param(e, dtype, id=f"{e[0]}-{str(dtype)[6:]}")
                 for e in ENTRIES for dtype in (torch.bfloat16, torch.float16, torch.float32)
                 if not (e[1] == "prodigy" and dtype == torch.float16)]


@pytest.mark.parametrize(("entry", "dtype"), LOW_PRECISION)
def test_low_precision_leaves_follow_the_float64_run(entry: tuple[str, str, Any],
                                                     dtype: torch.dtype) -> None:
    # The maths runs in at least float32, so three steps on bf16 / fp16 / fp32 params stay
    # within the storage dtype's rounding of the float64 run.
    gen = torch.Generator().manual_seed(0)
    p64 = {"w": torch.randn(4, 3, generator=gen, dtype=F64),
           "b": torch.randn(3, generator=gen, dtype=F64)}
    g64 = [{k: torch.randn(v.shape, generator=gen, dtype=F64) + 1 for k, v in p64.items()}
           for _ in range(3)]
    runs = {}
    for run_dtype in (F64, dtype):
        params = {k: v.to(run_dtype) for k, v in p64.items()}
        tx = entry[2]()
        state = tx.init(params)
        for g in g64:
            grads = {k: v.to(run_dtype) for k, v in g.items()}
            updates, state = tx.update(grads, state, params)
            assert all(updates[k].dtype == run_dtype for k in updates)
            params = functopt.apply_updates(params, updates)
        runs[run_dtype] = params
    tol = {torch.bfloat16: 5e-2, torch.float16: 1e-2, torch.float32: 1e-4}[dtype]
    for k in p64:
        torch.testing.assert_close(runs[dtype][k].to(F64), runs[F64][k], rtol=tol, atol=tol)


def test_schedule_free_eval_params_is_pure_and_needs_its_state() -> None:
    params = {"w": torch.tensor([1.0, 2.0])}
    tx = contrib.schedule_free_sgd(0.5)
    state = tx.init(params)
    updates, state = tx.update({"w": torch.tensor([1.0, -1.0])}, state, params)
    params = functopt.apply_updates(params, updates)
    snapshot = params["w"].clone()
    x = contrib.schedule_free_eval_params(state, params)
    assert torch.equal(params["w"], snapshot) and x["w"] is not params["w"]
    # x sits between y and z: y = b1 x + (1 - b1) z.
    torch.testing.assert_close(0.9 * x["w"] + 0.1 * state.z["w"], params["w"])
    with pytest.raises(TypeError, match=r"schedule_free_eval_params: state must be the "
                                        r"ScheduleFreeState .* got tuple"):
        contrib.schedule_free_eval_params((state,), params)


def test_muon_sends_matrices_to_muon_and_the_rest_to_adam() -> None:
    params = {"w": torch.randn(4, 3, dtype=F64), "k": torch.randn(2, 3, 2, dtype=F64),
              "b": torch.randn(3, dtype=F64)}
    grads = {k: torch.randn(v.shape, dtype=F64) for k, v in params.items()}
    opt = contrib.muon(0.1)
    updates, _ = opt.update(grads, opt.init(params), params)
    adam = functopt.adamw(0.1, weight_decay=0.0, nesterov=True)
    for k in ("k", "b"):  # not 2-D: AdamW (nesterov, as muon passes it on)
        expected, _ = adam.update({k: grads[k]}, adam.init({k: params[k]}), {k: params[k]})
        torch.testing.assert_close(updates[k], expected[k], rtol=1e-14, atol=0)
    # The matrix: -lr * sqrt(max(1, 3/4)) * NS(g); orthogonal rows up to Muon's band.
    s = torch.linalg.svdvals(updates["w"] / -0.1)
    assert bool((s > 0.3).all() and (s < 1.25).all())


# --- errors name what was wrong and how to fix it ------------------------------------------

@pytest.mark.parametrize(("build", "message"), [
    (lambda: C.muon(-1.0), r"muon: learning_rate must be in \[0, inf\), got -1.0"),
    (lambda: C.muon(0.1, ns_coeffs="fast"), r"unknown ns_coeffs preset 'fast'.*'dion'"),
    (lambda: C.scale_by_muon(ns_coeffs=(1.0, 2.0)), r"ns_coeffs must have shape \(3,\) or "
                                                     r"\(n, 3\), got \(2,\)"),
    (lambda: C.scale_by_muon(ns_coeffs=((1, 2, 3),) * 6), r"6 rows of ns_coeffs but "
                                                          r"ns_steps=5"),
    (lambda: C.scale_by_muon(ns_steps=0), r"ns_steps must be an int >= 1, got 0"),
    (lambda: C.scale_by_muon(beta=1.0), r"beta must be in \[0, 1\), got 1.0"),
    (lambda: C.scale_by_muon(preconditioning="svd"), r"unknown preconditioning 'svd'"),
    (lambda: C.schedule_free(functopt.sgd(0.1), 0.1, b1=0.0), r"b1 must be in \(0, 1\]"),
    (lambda: C.schedule_free(functopt.sgd, 0.1), r"base_optimizer must be a "
                                                 r"functopt.GradientTransformation.*factory"),
    (lambda: C.schedule_free_adamw(b2=1.5), r"decay must be in \[0, 1\)"),
    (lambda: C.adopt(0.1, b2=-0.1), r"b2 must be in \[0, 1\)"),
    (lambda: C.scale_by_adopt(clip_value_fn=1.0), r"clip_value_fn must be callable"),
    (lambda: C.ademamix(0.1, b3=2.0), r"b3 must be in \[0, 1\], got 2.0"),
    (lambda: C.simplified_ademamix(0.1, eps=-1.0), r"eps must be in \[0, inf\)"),
    (lambda: C.prodigy(betas=0.9), r"prodigy: betas must be a pair"),
    (lambda: C.prodigy(estim_lr0=0.0), r"estim_lr0 must be in \(0, inf\), got 0.0"),
    (lambda: C.dadapt_adamw(betas=(0.9, 1.0)), r"betas\[1\] must be in \[0, 1\)"),
    (lambda: C.madgrad(0.1, momentum=1.0), r"momentum must be in \[0, 1\), got 1.0"),
])
def test_bad_hyperparameters_fail_clearly(build: Any, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        build()


def test_muon_leaf_errors_name_the_leaf() -> None:
    dims = {"w": contrib.MuonDimensionNumbers(), "b": contrib.MuonDimensionNumbers()}
    opt = contrib.muon(0.1, muon_weight_dimension_numbers=dims)
    params = {"w": torch.ones(2, 2), "b": torch.ones(2)}
    with pytest.raises(ValueError, match=r"'b' has shape \(2,\); Muon orthogonalises "
                                         r"matrices.*Fix: give this leaf None"):
        opt.update(params, opt.init(params), params)
    tx = contrib.scale_by_muon()
    with pytest.raises(ValueError, match=r"'b' has shape \(2,\)"):
        tx.update(params, tx.init(params))
    overlap = contrib.scale_by_muon(weight_dimension_numbers=contrib.MuonDimensionNumbers(0, 0))
    with pytest.raises(ValueError, match=r"'w': the reduction axes \(0,\) and output axes "
                                         r"\(0,\) overlap"):
        overlap.update({"w": torch.ones(2, 2)}, overlap.init({"w": torch.ones(2, 2)}))
    pair = contrib.scale_by_muon(weight_dimension_numbers={"w": (0, 1)})
    with pytest.raises(ValueError, match=r"does not line up with the updates \(at 'w'.*"
                                         r"write MuonDimensionNumbers\(0, 1\)"):
        pair.update({"w": torch.ones(2, 2)}, pair.init({"w": torch.ones(2, 2)}))
    bad = contrib.scale_by_muon(weight_dimension_numbers={"w": "rows"})
    with pytest.raises(TypeError, match=r"at 'w' is str 'rows'; expected a "
                                        r"MuonDimensionNumbers or None"):
        bad.update({"w": torch.ones(2, 2)}, bad.init({"w": torch.ones(2, 2)}))


@pytest.mark.parametrize("build", [lambda: C.prodigy(), lambda: C.dadapt_adamw(),
                                   lambda: C.madgrad(0.1), lambda: C.schedule_free_sgd()])
def test_transforms_that_read_params_say_so(build: Any) -> None:
    tx = build()
    params = {"w": torch.ones(2)}
    with pytest.raises(ValueError, match=r"reads the params, but update\(\) was called "
                                         r"without them"):
        tx.update(params, tx.init(params))


# --- a 0-d leaf is computed exactly like a one-element leaf (as in tests/test_zero_dim.py) --


def _same_bits(zero_dim: Any, one_elem: Any, what: str) -> None:
    a_leaves, a_spec = functopt.tree._core.flatten(zero_dim)
    b_leaves, b_spec = functopt.tree._core.flatten(one_elem)
    assert a_spec == b_spec, f"{what}: different structures"
    for a, b in zip(a_leaves, b_leaves, strict=True):
        assert (a is None) == (b is None), what
        if a is None:
            continue
        assert a.dtype == b.dtype and a.numel() == b.numel(), what
        if a.is_floating_point() and bool(torch.isnan(a).all()) and bool(torch.isnan(b).all()):
            continue  # NaN payloads are not part of the contract
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), (
            f"{what}: {a.tolist()} (0-d leaf) != {b.tolist()} (shape-(1,) leaf)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("entry", ENTRIES, ids=[e[0] for e in ENTRIES])
@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_zero_dim_leaf_equals_one_element_leaf(entry: tuple[str, str, Any], dtype: torch.dtype,
                                               data: st.DataObject) -> None:
    companion = data.draw(st.one_of(st.none(), fst.tensors(fst.dtypes(), (2, 3), "typical")))
    param = data.draw(fst.values(dtype, "typical"))
    kind = data.draw(st.sampled_from(["finite", "any"]))
    grad_values = data.draw(st.lists(fst.values(dtype, kind), min_size=3, max_size=4))

    def tree(value: float, shape: tuple[int, ...]) -> dict[str, Any]:
        out: dict[str, Any] = {"w": torch.tensor(value, dtype=dtype).reshape(shape)}
        if companion is not None:
            out["c"] = companion
        return out

    results = {}
    for shape in [(), (1,)]:
        params = tree(param, shape)
        tx = entry[2]()
        state = tx.init(params)
        steps = [(None, state)]
        for g in grad_values:
            updates, state = tx.update(tree(g, shape), state, params)
            params = functopt.apply_updates(params, updates)
            steps.append((updates, state))
        results[shape] = steps
    for step, ((u0, s0), (u1, s1)) in enumerate(zip(results[()], results[(1,)], strict=True)):
        _same_bits(s0, s1, f"state after {step} step(s)")
        if step:
            _same_bits(u0, u1, f"updates of step {step}")
            assert u0["w"].shape == () and u0["w"].dtype == dtype


@pytest.mark.parametrize("entry", ENTRIES, ids=[e[0] for e in ENTRIES])
def test_update_batches_under_vmap_and_differentiates(entry: tuple[str, str, Any]) -> None:
    # The pure path works under torch.func: one update per row of a batch of gradients
    # equals the updates one by one, and the update has a gradient with respect to the grads.
    gen = torch.Generator().manual_seed(1)
    params = {"w": torch.randn(3, 2, generator=gen, dtype=F64),
              "b": torch.randn(2, generator=gen, dtype=F64)}
    tx = entry[2]()
    state = tx.init(params)
    _, state = tx.update({k: torch.randn(v.shape, generator=gen, dtype=F64) + 1
                          for k, v in params.items()}, state, params)
    gw = torch.randn(4, 3, 2, generator=gen, dtype=F64)
    gb = torch.randn(4, 2, generator=gen, dtype=F64)

    def step(w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        updates, _ = tx.update({"w": w, "b": b}, state, params)
        return updates["w"], updates["b"]

    batched = torch.func.vmap(step)(gw, gb)
    for i in range(4):
        one = step(gw[i], gb[i])
        torch.testing.assert_close(batched[0][i], one[0], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(batched[1][i], one[1], rtol=1e-12, atol=1e-14)
    d = torch.func.grad(lambda w: step(w, gb[0])[0].sum())(gw[0])
    assert d.shape == gw[0].shape and bool(torch.isfinite(d).all())


@pytest.mark.parametrize("factory", [contrib.schedule_free_sgd, contrib.schedule_free_adamw])
@pytest.mark.parametrize("warmup_from_zero", [True, False])
def test_schedule_free_with_zero_warmup_steps_trains_as_without_warmup(
        factory: Any, warmup_from_zero: bool) -> None:
    # A warmup over no steps is no warmup, from either starting point: the run equals the
    # one without warmup, and the params move.
    def run(**kwargs: Any) -> dict[str, torch.Tensor]:
        opt = factory(0.1, **kwargs)
        params = {"w": torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)}
        state = opt.init(params)
        for _ in range(3):
            updates, state = opt.update({"w": params["w"] * 0.5}, state, params)
            params = functopt.apply_updates(params, updates)
        return params

    start = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)
    got = run(warmup_steps=0, warmup_from_zero=warmup_from_zero)
    assert not torch.equal(got["w"], start)
    assert_bitwise_equal(got, run())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(3, 8, 8), (2, 5, 12), (1, 12, 5)], ids=str)
def test_newton_schulz_into_buffers_is_the_step_loop_bitwise(
        dtype: torch.dtype, shape: tuple[int, int, int]) -> None:
    # outside autograd the iteration writes its products into buffers; under autograd (and
    # torch.func) it runs the plain step loop: the same bits either way
    from functopt.contrib import _muon

    rows = [(3.4445, -4.775, 2.0315)] * 4 + [(3.0, -3.2, 1.2)]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    x = x / torch.linalg.matrix_norm(x, keepdim=True)
    if shape[1] > shape[2]:
        x = x.mT
    loop = x
    for i, row in enumerate(rows):
        loop = _muon._newton_schulz_step(loop, row, i == 0, "frobenius")
    assert_bitwise_equal(_muon._newton_schulz_into_buffers(x, rows), loop)
    # and the dispatch: a tensor that requires grad takes the loop, and is differentiable
    assert _muon._plain(x) and not _muon._plain(x.clone().requires_grad_())
    y = x.detach().clone().requires_grad_()
    _muon._orthogonalize(y, rows, "frobenius", 1e-7, True).sum().backward()
    assert y.grad is not None and bool(torch.isfinite(y.grad).all())
