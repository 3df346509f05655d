"""Master-weight strategies: float32 master, Kahan summation, stochastic rounding.

Stochastic rounding is checked bitwise against the two neighbours found with ``nextafter``
in the low dtype, for unbiasedness with a 5-sigma bound, and for determinism; Kahan
summation against its definition; all three inside ``mixed_precision`` against a float64
reference on updates below half a unit in the last place, and for leaving no trace on a
skipped step. The bytes-per-parameter tables in ``master.py``'s docstring are measured here.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functopt
from functopt.precision import (
    MasterWeights,
    dynamic_loss_scale,
    float32_master,
    kahan_summation,
    master,
    mixed_precision,
    stochastic_rounding,
)
from functopt.testing import strategies as fst
from functopt.tree import _core

LOW = (torch.bfloat16, torch.float16)
MANT = {torch.bfloat16: 7, torch.float16: 10}  # explicit significand bits
INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16,
            torch.float32: torch.int32, torch.float64: torch.int64}

# Round-to-nearest with no master and float32 update maths: the baseline that loses tiny updates.
ROUND_TO_NEAREST = MasterWeights(
    init=lambda p: None,
    view=lambda p, s: p.float() if torch.finfo(p.dtype).bits < 32 else p,
    write=lambda p, s, v, g: (v.to(p.dtype), None),
    dtype=torch.float32,
    needs_generator=False,
)
STRATEGIES = {"float32_master": float32_master, "kahan_summation": kahan_summation,
              "stochastic_rounding": stochastic_rounding}


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(INT_VIEW[x.dtype]) if x.is_floating_point() else x


def _same_bits(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _trees_same_bits(a: Any, b: Any) -> bool:
    a_leaves, a_spec = _core.flatten(a)
    b_leaves, b_spec = _core.flatten(b)
    return a_spec == b_spec and all(
        (x is None and y is None) or (isinstance(x, torch.Tensor) and _same_bits(x, y))
        or (not isinstance(x, torch.Tensor) and x == y)
        for x, y in zip(a_leaves, b_leaves, strict=True)
    )


def _clone(tree: Any) -> Any:
    leaves, spec = _core.flatten(tree)
    return _core.unflatten(spec, [x.clone() if isinstance(x, torch.Tensor) else x for x in leaves])


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _neighbours(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The representable values of ``dtype`` just below and above float32 ``x`` (equal when
    ``x`` is representable), found with round-to-nearest and nextafter in ``dtype``."""
    r = x.to(dtype)
    up = torch.full_like(r, math.inf)
    down = torch.full_like(r, -math.inf)
    exact = (r.float() == x) | torch.isnan(x)
    lo = torch.where(exact | (r.float() < x), r, torch.nextafter(r, down))
    hi = torch.where(exact | (r.float() > x), r, torch.nextafter(r, up))
    return lo, hi


def _sr(x: torch.Tensor, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    mw = stochastic_rounding()
    p = torch.zeros(x.shape, dtype=dtype)
    new, store = mw.write(p, mw.init(p), x, _gen(seed))
    assert store is None
    return new


def _assert_neighbour(x: torch.Tensor, out: torch.Tensor) -> None:
    lo, hi = _neighbours(x, out.dtype)
    nan = torch.isnan(x)
    assert bool((torch.isnan(out) == nan).all())
    ok = (_bits(out) == _bits(lo)) | (_bits(out) == _bits(hi)) | nan
    assert bool(ok.all()), (x[~ok], out[~ok], lo[~ok], hi[~ok])
    exact = lo.float() == hi.float()
    assert bool(((_bits(out) == _bits(lo)) | ~exact | nan).all()), "a representable value moved"


# ---------------------------------------------------------------- stochastic rounding


def _edge_values(dtype: torch.dtype) -> torch.Tensor:
    info = torch.finfo(dtype)
    tiny, top = info.smallest_normal, info.max
    vals = [0.0, -0.0, 1.0, -1.0, 1.0 + 1e-4, -(1.0 + 1e-4), 2.0 - 1e-6, 3.3, math.pi,
            tiny, tiny * 0.75, tiny * 2 ** -5 * 1.3, tiny * 2 ** -12, -tiny * 0.3, 1e-40,
            -1e-45, top, -top, math.inf, -math.inf, math.nan]
    vals += [min(top * (1 + 2 ** -12), 3.4e38), -min(top * (1 + 2 ** -12), 3.4e38)]
    return torch.tensor(vals, dtype=torch.float32)


@pytest.mark.parametrize("dtype", LOW)
def test_sr_edge_values_round_to_a_neighbour(dtype: torch.dtype) -> None:
    x = _edge_values(dtype).repeat(200)
    for seed in range(3):
        _assert_neighbour(x, _sr(x, dtype, seed))


@pytest.mark.parametrize("dtype", LOW)
def test_sr_keeps_every_nan_a_nan(dtype: torch.dtype) -> None:
    # payloads only in the bits that get truncated, and the top pattern (adding would wrap)
    bits = torch.tensor([0x7F800001, 0x7F80FFFF, 0x7FC00000, -1, -0x7F0001, -0x800000 + 1],
                        dtype=torch.int32)
    x = bits.view(torch.float32).repeat(500)
    assert bool(torch.isnan(x).all())
    assert bool(torch.isnan(_sr(x, dtype, seed=2)).all())


@settings(max_examples=60)
@given(x=fst.tensors(torch.float32, fst.shapes(max_side=6), "any"), dtype=st.sampled_from(LOW),
       seed=st.integers(0, 2 ** 31))
def test_sr_is_always_a_neighbour(x: torch.Tensor, dtype: torch.dtype, seed: int) -> None:
    x = x * 1.001 + 1e-9 * (x == 0)  # move representable values off the grid (some stay on)
    x_before = x.clone()
    out = _sr(x, dtype, seed)
    assert out.dtype == dtype and out.shape == x.shape
    assert _same_bits(x, x_before)
    _assert_neighbour(x, out)


@pytest.mark.parametrize("dtype", LOW)
def test_sr_keeps_representable_values_exact(dtype: torch.dtype) -> None:
    all_bits = torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int32).to(torch.int16)
    values = all_bits.view(dtype)  # every value of the dtype, nan payloads included
    out = _sr(values.float(), dtype, seed=7)
    nan = torch.isnan(values)
    assert torch.equal(_bits(out)[~nan], _bits(values)[~nan])
    assert bool(torch.isnan(out[nan]).all())


def _unbiased_cases(dtype: torch.dtype) -> list[float]:
    info = torch.finfo(dtype)
    sub = info.smallest_normal * 2.0 ** -MANT[dtype]  # smallest subnormal spacing
    return [1.0 + 1e-3, -(1.0 + 1e-3), 1.0 - 1e-4, 3.0 + 1.0 / 3, 1e-3, -7.77e-5,
            info.smallest_normal * 0.37, sub * 0.3, -sub * 2.6, 1234.5678, 2.0 - 1e-5]


@pytest.mark.parametrize("dtype", LOW)
def test_sr_is_unbiased(dtype: torch.dtype) -> None:
    n = 20_000
    cases = torch.tensor(_unbiased_cases(dtype), dtype=torch.float32)
    out = _sr(cases.repeat_interleave(n), dtype, seed=1234).double().reshape(len(cases), n)
    lo, hi = _neighbours(cases, dtype)
    spacing = hi.double() - lo.double()
    frac = (cases.double() - lo.double()) / spacing  # P(round to hi), exact in float64
    assert bool(((frac > 0) & (frac < 1)).all())
    sigma = spacing * torch.sqrt(frac * (1 - frac) / n)
    err = (out.mean(dim=1) - cases.double()).abs()
    assert bool((err <= 5 * sigma).all()), (cases, err / sigma)
    # and the draws really spread over both neighbours
    assert bool(((out == lo.double()[:, None]).any(1) & (out == hi.double()[:, None]).any(1)).all())


def test_sr_float16_beyond_max() -> None:
    n = 20_000
    top = torch.finfo(torch.float16).max  # 65504, spacing 32 below 2**16
    x = torch.tensor([top, top + 8.0, -(top + 24.0), 65536.0, 1e6, -3e38])
    out = _sr(x.repeat_interleave(n), torch.float16, seed=3).reshape(len(x), n).float()
    assert bool((out[0] == top).all())  # the maximum itself never overflows
    for row, p_inf in ((1, 8 / 32), (2, 24 / 32)):
        frac_inf = torch.isinf(out[row]).double().mean().item()
        assert abs(frac_inf - p_inf) <= 5 * math.sqrt(p_inf * (1 - p_inf) / n)
        assert bool((torch.isinf(out[row]) | (out[row].abs() == top)).all())
    assert bool((out[3:].abs() == math.inf).all()) and bool((out[5] < 0).all())


def test_sr_bfloat16_beyond_max() -> None:
    top = torch.finfo(torch.bfloat16).max
    x = torch.tensor([top, 3.4e38, -3.4e38])  # 3.4e38 lies between max and max + spacing
    out = _sr(x.repeat(5000), torch.bfloat16, seed=4).float().reshape(5000, 3)
    assert bool((out[:, 0] == top).all())
    assert bool((torch.isinf(out[:, 1:]) | (out[:, 1:].abs() == top)).all())
    assert bool(torch.isinf(out[:, 1:]).any() and (out[:, 1:].abs() == top).any())


@pytest.mark.parametrize("dtype", LOW)
def test_sr_is_deterministic_given_the_generator_seed(dtype: torch.dtype) -> None:
    x = torch.linspace(-3, 3, 4099)[1:].reshape(1, -1) + 1e-3
    a, b, c = _sr(x, dtype, 5), _sr(x, dtype, 5), _sr(x, dtype, 6)
    assert _same_bits(a, b)
    assert not _same_bits(a, c)


def test_sr_step_is_deterministic_given_the_key() -> None:
    opt = mixed_precision(functopt.sgd(2.0 ** -12), master_weights=stochastic_rounding())
    params = {"w": torch.linspace(1, 2, 512).to(torch.bfloat16),
              "h": torch.linspace(-1, 1, 512).to(torch.float16)}
    grads = {"w": torch.full((512,), 1.0, dtype=torch.bfloat16),
             "h": torch.full((512,), 1.0, dtype=torch.float16)}
    state = opt.init(params)
    p1, s1 = opt.step(grads, state, params)
    p2, s2 = opt.step(grads, state, params)
    assert _trees_same_bits(p1, p2) and int(s1.key) == int(s2.key) == 1
    p3, _ = opt.step(grads, s1, params)  # same inputs, next key: other random bits
    assert not _trees_same_bits(p1, p3)


def test_sr_needs_a_generator_for_low_precision() -> None:
    mw = stochastic_rounding()
    p = torch.ones(3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"needs a torch\.Generator .*bfloat16.*got None"):
        mw.write(p, None, p.float(), None)
    wide = torch.ones(3, dtype=torch.float64)  # nothing to round: no generator needed
    new, store = mw.write(wide, mw.init(wide), wide + 1, None)
    assert store is None and torch.equal(new, wide + 1)


def test_sr_rejects_other_low_precision_dtypes() -> None:
    p = torch.zeros(2, dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match=r"cannot round to torch\.float8_e4m3fn.*float32_master"):
        stochastic_rounding().init(p)
    with pytest.raises(TypeError, match=r"cannot round to torch\.float8_e4m3fn"):
        stochastic_rounding().write(p, None, p.float(), _gen(0))


def test_float32_master_rejects_non_floating_dtype() -> None:
    with pytest.raises(TypeError, match=r"dtype must be a floating torch\.dtype, got torch\.int32"):
        float32_master(torch.int32)


# ---------------------------------------------------------------- Kahan summation


@settings(max_examples=60)
@given(pg=fst.params_and_gradients(dtypes=(*LOW, torch.float32), param_kind="finite",
                                   grad_kind="any"))
def test_kahan_write_matches_its_definition(pg: tuple[Any, Any]) -> None:
    params, values = pg
    mw = kahan_summation()
    for p, v in zip(_core.flatten(params)[0], _core.flatten(values)[0], strict=True):
        c = mw.init(p)
        x = v.float() if c is not None else v
        x_before = x.clone()
        new_p, new_c = mw.write(p, c, x, None)
        assert _same_bits(x, x_before) and new_p.dtype == p.dtype and new_p.shape == p.shape
        if c is None:
            assert new_c is None and _same_bits(new_p, x)
            continue
        assert torch.equal(_bits(new_p), _bits(x.to(p.dtype)))
        assert new_c.dtype == p.dtype and c.abs().sum() == 0
        finite = torch.isfinite(new_p)
        residual = x.double() - new_p.double()  # exact: the float32 subtraction is exact too
        assert torch.equal(new_c[finite].double(), residual[finite].float().to(p.dtype).double())
        assert bool((new_c[~finite] == 0).all())
        # |c| <= half a unit in the last place of p: the pair is two non-overlapping words
        _, hi = _neighbours(new_p.float().abs()[finite], p.dtype)
        half_ulp = (hi.double() - new_p.double().abs()[finite]) / 2
        assert bool((new_c[finite].double().abs() <= half_ulp).all())


def test_kahan_overflow_reads_inf_not_nan() -> None:
    mw = kahan_summation()
    p = torch.tensor([65504.0, -1.0], dtype=torch.float16)
    new_p, new_c = mw.write(p, mw.init(p), torch.tensor([70000.0, -1e6]), None)
    assert torch.isinf(new_p).all() and (new_c == 0).all()
    assert torch.equal(mw.view(new_p, new_c), torch.tensor([math.inf, -math.inf]))


def test_kahan_pair_holds_about_two_words_of_precision() -> None:
    # bfloat16: 8 significant bits per word, so p + c carries about 16 (float32: 24).
    x = torch.rand(10_000, generator=_gen(0)) + 1.0
    mw = kahan_summation()
    p = torch.ones(x.shape, dtype=torch.bfloat16)
    view = mw.view(*mw.write(p, mw.init(p), x, None))
    rel = ((view.double() - x.double()) / x.double()).abs().max().item()
    assert rel <= 2.0 ** -16
    assert rel > 2.0 ** -24  # and not float32's precision: the docstring's claim is tight


# ---------------------------------------------------------------- inside mixed_precision


def _run(mw: MasterWeights, p0: torch.Tensor, lr: float, steps: int) -> torch.Tensor:
    opt = mixed_precision(functopt.sgd(lr), master_weights=mw)
    params = {"w": p0}
    state = opt.init(params)
    grads = {"w": torch.full_like(p0, -1.0)}
    for _ in range(steps):
        params, state = opt.step(grads, state, params)
    return mw.view(params["w"], state.master["w"]).double()


@pytest.mark.parametrize("dtype", LOW)
def test_updates_below_half_an_ulp(dtype: torch.dtype) -> None:
    """Each step adds a tenth of the spacing at 1.5: round-to-nearest never moves, the
    float32 master and Kahan follow the float64 sum closely, stochastic rounding follows it
    on average."""
    n, steps = 4096, 300
    p0 = torch.full((n,), 1.5, dtype=dtype)
    spacing = 2.0 ** -MANT[dtype]  # in [1, 2)
    lr = spacing / 10
    reference = 1.5 + steps * float(torch.tensor(lr, dtype=torch.float32))
    err = {name: _run(mw, p0, lr, steps) - reference for name, mw in (
        ("nearest", ROUND_TO_NEAREST), ("float32_master", float32_master()),
        ("kahan", kahan_summation()), ("stochastic", stochastic_rounding()))}
    in_ulps = {k: (v.abs().max().item() / spacing, v.mean().item() / spacing)
               for k, v in err.items()}
    assert in_ulps["nearest"][0] == pytest.approx(steps / 10, rel=1e-6)  # lost every update
    assert in_ulps["float32_master"][0] < 0.01
    assert in_ulps["kahan"][0] < 0.1  # bfloat16 ~0.06, float16 ~1e-4: near float32's 0.002-0.007
    # stochastic rounding: each element a random walk; the mean is the reference within
    # 5 sigma (per step the rounding variance is at most spacing**2 / 4).
    sigma = math.sqrt(steps / 4 / n)
    assert abs(in_ulps["stochastic"][1]) < 5 * sigma
    assert in_ulps["stochastic"][0] < 5 * math.sqrt(steps / 4) + 1


@settings(max_examples=30)
@given(pg=fst.params_and_gradients(dtypes=(*LOW, torch.float32), grad_kind="any",
                                   allow_none=True),
       name=st.sampled_from(sorted(STRATEGIES)), scaled=st.booleans())
def test_step_properties(pg: tuple[Any, Any], name: str, scaled: bool) -> None:
    params, grads = pg
    mw = STRATEGIES[name]()
    opt = mixed_precision(functopt.sgd(0.125, momentum=0.5), master_weights=mw,
                          loss_scale=dynamic_loss_scale(4.0) if scaled else None)
    state = opt.init(params)
    finite_grads = _core.unflatten(_core.flatten(grads)[1], [
        None if g is None else torch.nan_to_num(g, nan=1.0, posinf=2.0, neginf=-2.0)
        for g in _core.flatten(grads)[0]])
    warm_params, state = opt.step(finite_grads, state, params)  # a state with history
    before = (_clone(warm_params), _clone(grads), _clone(state))
    new_params, new_state = opt.step(grads, state, warm_params)
    assert _trees_same_bits((warm_params, grads, state), before)  # purity
    assert fst.same_layout(new_params, warm_params)
    assert fst.same_layout(new_state.master, state.master)
    if any(g is not None and not bool(torch.isfinite(g).all()) for g in _core.flatten(grads)[0]):
        assert bool(new_state.metrics.found_inf)
    if bool(new_state.metrics.found_inf):  # no trace: params, store, inner state as before
        assert _trees_same_bits(new_params, warm_params)
        assert _trees_same_bits(new_state.master, state.master)
        assert _trees_same_bits(new_state.inner_state, state.inner_state)
        return
    for p, s, new_p, new_s, g in zip(*(_core.flatten(t)[0] for t in (
            warm_params, state.master, new_params, new_state.master, grads)), strict=True):
        if g is None:  # a param without a gradient keeps its value and its store
            assert _same_bits(new_p, p) and _same_bits(new_s, s)


@settings(max_examples=40)
@given(pg=fst.params_and_gradients(dtypes=(*LOW, torch.float32), param_kind="finite"),
       name=st.sampled_from(sorted(STRATEGIES)), seed=st.integers(0, 1000))
def test_step_writes_through_the_strategy(pg: tuple[Any, Any], name: str, seed: int) -> None:
    """After a warm-up step (a non-zero store), each leaf is the strategy's write of the
    float32 value view + update, checked against each strategy's definition."""
    params, grads = pg
    mw = STRATEGIES[name]()
    opt = mixed_precision(functopt.sgd(0.125), master_weights=mw)
    state = opt.init(params)
    state = state._replace(key=torch.tensor(seed, dtype=torch.int64))
    params, state = opt.step(grads, state, params)
    new_params, new_state = opt.step(grads, state, params)
    if bool(new_state.metrics.found_inf):  # a finite but huge norm overflowed float32
        assert _trees_same_bits(new_params, params)
        return
    for p, s, g, new_p, new_s in zip(*(_core.flatten(t)[0] for t in (
            params, state.master, grads, new_params, new_state.master)), strict=True):
        value = mw.view(p, s) + g.float() * -0.125  # sgd's update, exact for lr 2**-3
        assert new_p.dtype == p.dtype
        if p.dtype not in LOW:
            assert s is None and new_s is None and _same_bits(new_p, value)
        elif name == "float32_master":
            assert _same_bits(new_s, value) and _same_bits(new_p, value.to(p.dtype))
        elif name == "kahan_summation":
            assert _same_bits(new_p, value.to(p.dtype))
            finite = torch.isfinite(new_p)
            residual = (value - new_p.float()).to(p.dtype)
            assert _same_bits(new_s[finite], residual[finite]) and bool((new_s[~finite] == 0).all())
        else:
            assert s is None and new_s is None
            _assert_neighbour(value, new_p)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_inf_grad_leaves_no_trace(name: str) -> None:
    mw = STRATEGIES[name]()
    opt = mixed_precision(functopt.adam(1e-2), master_weights=mw,
                          loss_scale=dynamic_loss_scale(2.0 ** 10))
    params = {"a": torch.linspace(-1, 1, 33).to(torch.bfloat16),
              "b": torch.linspace(-2, 2, 17).to(torch.float16), "c": torch.ones(3)}
    grads = {k: torch.full_like(v, 3.0) for k, v in params.items()}
    state = opt.init(params)
    for _ in range(3):  # give the store and the moments some history
        params, state = opt.step(grads, state, params)
    bad = {**grads, "b": grads["b"].clone().index_fill_(0, torch.tensor([4]), math.inf)}
    new_params, new_state = opt.step(bad, state, params)
    assert bool(new_state.metrics.found_inf)
    assert _trees_same_bits(new_params, params)
    assert _trees_same_bits(new_state.master, state.master)
    assert _trees_same_bits(new_state.inner_state, state.inner_state)
    assert new_state.loss_scale.scale.item() == state.loss_scale.scale.item() / 2


# ---------------------------------------------------------------- bytes per parameter


def _tables(doc: str) -> dict[tuple[str, ...], dict[str, list[int]]]:
    """The markdown tables of ``doc`` whose rows start with a code name: header -> key ->
    the integers after '=' in each cell (checking that 'a + b = c' adds up)."""
    tables: dict[tuple[str, ...], dict[str, list[int]]] = {}
    header: tuple[str, ...] | None = None
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if not cells:
            header = None
        elif cells[0] == "strategy":
            header = tuple(cells)
            tables[header] = {}
        elif header is not None and cells[0].startswith("``"):
            numbers = []
            for cell in cells[1:]:
                if "=" in cell:
                    lhs, rhs = cell.split("=")
                    assert sum(int(t) for t in lhs.split("+")) == int(rhs), line
                    numbers.append(int(rhs))
            tables[header][cells[0]] = numbers
    return tables


def _bytes_per_param(mw: MasterWeights, inner: functopt.GradientTransformation) -> float:
    n = 1024
    params = {"w": torch.zeros(n, dtype=torch.bfloat16)}
    state = mixed_precision(inner, master_weights=mw).init(params)
    leaves = [x for x in _core.flatten((params, state.master, state.inner_state))[0]
              if isinstance(x, torch.Tensor)]
    per_param = [x for x in leaves if x.numel() == n]
    assert all(x.numel() <= 1 for x in leaves if x.numel() != n)  # counters only
    return sum(x.nbytes for x in per_param) / n


def test_bytes_per_parameter_tables_are_measured() -> None:
    tables = _tables(master.__doc__ or "")
    store_table = tables[("strategy", "store", "bytes")]
    adam_table = tables[("strategy", "float32 moments", "bfloat16 moments")]
    configs = {
        "``float32_master()``": float32_master(),
        "``kahan_summation()``": kahan_summation(),
        "``stochastic_rounding()``": stochastic_rounding(),
        "``float32_master(torch.bfloat16)`` (bfloat16 maths, no master)":
            float32_master(torch.bfloat16),
    }
    assert set(store_table) == set(configs)
    for key, mw in configs.items():
        assert _bytes_per_param(mw, functopt.sgd(0.1)) == store_table[key][0], key
    bf16 = torch.bfloat16
    low_moments = functopt.chain(functopt.scale_by_adam(mu_dtype=bf16, nu_dtype=bf16),
                                 functopt.scale_by_learning_rate(1e-3))
    assert set(adam_table) == set(configs) - {"``float32_master(torch.bfloat16)`` "
                                              "(bfloat16 maths, no master)"}
    for key, (full, low) in adam_table.items():
        assert _bytes_per_param(configs[key], functopt.adam(1e-3)) == full, key
        assert _bytes_per_param(configs[key], low_moments) == low, key
    # adam's own mu_dtype halves only the first moment
    assert _bytes_per_param(float32_master(), functopt.adam(1e-3, mu_dtype=bf16)) == 6 + 2 + 4
