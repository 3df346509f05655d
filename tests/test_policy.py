"""Dtype policies: jmp's grammar and defaults, casts over pytrees, and the parse errors."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functopt
from functopt.precision import Policy, get_policy
from functopt.testing import strategies as fst
from functopt.tree import _core

F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
DTYPES = (F32, BF16, F16, F64)
NAMES = {F32: ("float32", "f32", "full"), BF16: ("bfloat16", "bf16"),
         F16: ("float16", "f16", "half"), F64: ("float64", "f64")}


@pytest.mark.parametrize(("text", "expected"), [
    ("params=float32,compute=bfloat16,output=float32", (F32, BF16, F32)),
    ("p=f32,c=bf16,o=f32", (F32, BF16, F32)),
    ("p=full,c=half,o=full", (F32, F16, F32)),
    # jmp's defaults: params float32, compute follows params, output follows compute
    ("c=f16", (F32, F16, F16)),
    ("p=f16,c=f16", (F16, F16, F16)),
    ("p=f16,c=bf16", (F16, BF16, BF16)),
    ("o=bf16", (F32, F32, BF16)),
    ("p=bf16", (BF16, BF16, BF16)),
    ("output=f64,params=f16", (F16, F16, F64)),  # order does not matter
    # one name for all three
    ("f32", (F32, F32, F32)), ("half", (F16, F16, F16)), ("bfloat16", (BF16, BF16, BF16)),
    # lenient about case and spaces
    (" P = F32 , C = BF16 ", (F32, BF16, BF16)), ("BF16", (BF16, BF16, BF16)),
])
def test_get_policy(text: str, expected: tuple[torch.dtype, ...]) -> None:
    assert get_policy(text) == Policy(*expected)


@given(dtypes=st.tuples(*[st.sampled_from(DTYPES)] * 3), data=st.data())
def test_every_name_parses_and_str_round_trips(dtypes: tuple[torch.dtype, ...],
                                               data: st.DataObject) -> None:
    keys = [data.draw(st.sampled_from(k)) for k in (("p", "params"), ("c", "compute"),
                                                    ("o", "output"))]
    names = [data.draw(st.sampled_from(NAMES[d])) for d in dtypes]
    order = data.draw(st.permutations(range(3)))
    text = ",".join(f"{keys[i]}={names[i]}" for i in order)
    policy = get_policy(text)
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == dtypes
    assert get_policy(str(policy)) == policy


def test_str_uses_short_names() -> None:
    assert str(Policy(F32, BF16, F16)) == "p=f32,c=bf16,o=f16"


@pytest.mark.parametrize(("text", "match"), [
    ("params=float32,compute=bfloat17", r"unknown dtype 'bfloat17' in .*known dtype names: bf16"),
    ("fp8", r"unknown dtype 'fp8' in 'fp8'"),
    ("", r"unknown dtype '' in ''"),
    ("p=int32", r"unknown dtype 'int32'"),
    ("param=f32", r"unknown key 'param' in 'param=f32'; keys are 'params' \(or 'p'\)"),
    ("p=f32,x=bf16", r"unknown key 'x'"),
    ("p=f32,,c=bf16", r"an empty entry in 'p=f32,,c=bf16' is not of the form key=dtype"),
    ("p=f32,", r"an empty entry"),
    ("p=f32,bf16", r"the entry 'bf16' in 'p=f32,bf16' is not of the form key=dtype"),
    ("p=f32,params=bf16", r"param dtype given twice in 'p=f32,params=bf16'"),
    ("c=f32,c=f32", r"compute dtype given twice"),
    ("p=f32=bf16", r"unknown dtype 'f32=bf16'"),
])
def test_get_policy_errors(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        get_policy(text)


def test_get_policy_rejects_non_strings() -> None:
    with pytest.raises(TypeError, match=r"policy must be a string .* got dtype torch\.float32"):
        get_policy(torch.float32)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [torch.int32, "float32", None, torch.bool])
def test_policy_checks_dtypes(bad: Any) -> None:
    with pytest.raises(TypeError, match=r"Policy: compute_dtype must be a floating torch\.dtype"):
        Policy(F32, bad, F32)
    with pytest.raises(TypeError, match=r"Policy: output_dtype must be a floating"):
        Policy(F32, F32, F32).with_output_dtype(bad)


def test_policy_is_frozen_and_hashable() -> None:
    policy = get_policy("p=f32,c=bf16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.param_dtype = F16  # type: ignore[misc]
    assert {policy: 1}[get_policy("params=float32,compute=bfloat16,output=bfloat16")] == 1


def test_with_dtype_methods_replace_one_field() -> None:
    policy = Policy(F32, BF16, F32)
    assert policy.with_param_dtype(F16) == Policy(F16, BF16, F32)
    assert policy.with_compute_dtype(F16) == Policy(F32, F16, F32)
    assert policy.with_output_dtype(F16) == Policy(F32, BF16, F16)
    assert policy == Policy(F32, BF16, F32)  # unchanged


@st.composite
def _trees(draw: st.DrawFn) -> Any:
    return draw(fst.pytrees(st.one_of(
        fst.tensors(st.sampled_from(DTYPES), fst.shapes(), "any"),
        st.none(),
        st.integers(-5, 5).map(lambda i: torch.tensor([i, 2 * i], dtype=torch.int64)),
        st.booleans().map(torch.tensor),
        st.floats(allow_nan=False),  # a Python number is not a tensor: it passes through
    )))


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1).view(torch.uint8)


@settings(max_examples=40)
@given(tree=_trees(), policy=st.builds(Policy, *[st.sampled_from(DTYPES)] * 3))
def test_casts_move_only_floating_tensors(tree: Any, policy: Policy) -> None:
    before = _core.flatten(tree)[0]
    snapshot = [x.clone() if isinstance(x, torch.Tensor) else x for x in before]
    for method, dtype in ((policy.cast_to_param, policy.param_dtype),
                          (policy.cast_to_compute, policy.compute_dtype),
                          (policy.cast_to_output, policy.output_dtype)):
        out = method(tree)
        assert functopt.tree.structure(out) == functopt.tree.structure(tree)
        for x, y in zip(before, _core.flatten(out)[0], strict=True):
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                assert y.dtype == dtype and y.shape == x.shape
                assert torch.equal(_bytes(y), _bytes(x.to(dtype)))
            else:
                assert y is x  # None, integer and boolean tensors, numbers: untouched
    for x, s in zip(before, snapshot, strict=True):  # inputs unchanged
        if isinstance(x, torch.Tensor):
            assert torch.equal(_bytes(x), _bytes(s))
        else:
            assert x == s


def test_bf16_forward_recipe() -> None:
    policy = get_policy("p=f32,c=bf16,o=f32")
    params = {"w": torch.randn(4, 3), "b": torch.zeros(3), "step": torch.tensor(7)}
    x = torch.randn(2, 4)
    p, xc = policy.cast_to_compute(params), policy.cast_to_compute(x)
    assert p["w"].dtype == xc.dtype == BF16 and p["step"].dtype == torch.int64
    out = policy.cast_to_output(xc @ p["w"] + p["b"])
    assert out.dtype == F32
    assert policy.cast_to_param(p)["w"].dtype == F32
