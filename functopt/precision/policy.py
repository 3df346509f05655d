"""Dtype policies, after jmp: which dtype params are kept in, computed in and returned in.

A [`Policy`][functopt.precision.Policy] holds three dtypes and casts pytrees to each;
[`get_policy`][functopt.precision.get_policy] parses jmp's policy strings
(``"params=float32,compute=bfloat16,output=float32"``, or ``"p=f32,c=bf16,o=f32"``). A
typical bfloat16 forward pass keeps float32 params (and optimizer state), casts params and
inputs to bfloat16 for the computation, and returns float32 outputs::

    policy = get_policy("p=f32,c=bf16,o=f32")
    out = policy.cast_to_output(model_fn(policy.cast_to_compute(params),
                                         policy.cast_to_compute(batch)))
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from functopt.tree import _ops

__all__ = ["Policy", "get_policy"]

# The first name of each dtype is the one str(Policy) prints.
_DTYPE_NAMES: dict[torch.dtype, tuple[str, ...]] = {
    torch.float32: ("f32", "float32", "full"),
    torch.bfloat16: ("bf16", "bfloat16"),
    torch.float16: ("f16", "float16", "half"),
    torch.float64: ("f64", "float64"),
}
_NAME_TO_DTYPE: dict[str, torch.dtype] = {
    name: dtype for dtype, names in _DTYPE_NAMES.items() for name in names
}
_KEYS: dict[str, str] = {
    "p": "param_dtype", "params": "param_dtype",
    "c": "compute_dtype", "compute": "compute_dtype",
    "o": "output_dtype", "output": "output_dtype",
}


def _check_dtype(field: str, value: Any) -> None:
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise TypeError(
            f"Policy: {field} must be a floating torch.dtype (e.g. torch.bfloat16), got "
            f"{value!r}. Fix: pass a torch dtype, or parse names with get_policy(...)."
        )


@dataclasses.dataclass(frozen=True)
class Policy:
    """The dtypes of params, of the computation and of outputs (jmp's ``Policy``).

    Each ``cast_to_*`` method casts the floating-point tensors of a pytree to one of the
    three dtypes with [`functopt.tree.cast`][functopt.tree.cast]; integer and boolean
    tensors, ``None`` and non-tensor leaves pass through unchanged (as in jmp).

    Args:
        param_dtype: the dtype params (and optimizer state) are stored in.
        compute_dtype: the dtype the forward and backward passes compute in.
        output_dtype: the dtype outputs (e.g. logits, the loss) are returned in.

    Examples:
        >>> import torch
        >>> from functopt.precision import Policy
        >>> policy = Policy(torch.float32, torch.bfloat16, torch.float32)
        >>> policy.cast_to_compute({"w": torch.ones(2), "step": torch.tensor(3), "b": None})
        {'w': tensor([1., 1.], dtype=torch.bfloat16), 'step': tensor(3), 'b': None}
        >>> str(policy)
        'p=f32,c=bf16,o=f32'
    """

    param_dtype: torch.dtype
    compute_dtype: torch.dtype
    output_dtype: torch.dtype

    def __post_init__(self) -> None:
        for field in ("param_dtype", "compute_dtype", "output_dtype"):
            _check_dtype(field, getattr(self, field))

    def cast_to_param(self, tree: Any) -> Any:
        """Cast the floating-point tensors of ``tree`` to ``param_dtype``."""
        return _ops.cast(tree, self.param_dtype)

    def cast_to_compute(self, tree: Any) -> Any:
        """Cast the floating-point tensors of ``tree`` to ``compute_dtype``."""
        return _ops.cast(tree, self.compute_dtype)

    def cast_to_output(self, tree: Any) -> Any:
        """Cast the floating-point tensors of ``tree`` to ``output_dtype``."""
        return _ops.cast(tree, self.output_dtype)

    def with_param_dtype(self, param_dtype: torch.dtype) -> Policy:
        """A copy with ``param_dtype`` replaced."""
        return dataclasses.replace(self, param_dtype=param_dtype)

    def with_compute_dtype(self, compute_dtype: torch.dtype) -> Policy:
        """A copy with ``compute_dtype`` replaced."""
        return dataclasses.replace(self, compute_dtype=compute_dtype)

    def with_output_dtype(self, output_dtype: torch.dtype) -> Policy:
        """A copy with ``output_dtype`` replaced."""
        return dataclasses.replace(self, output_dtype=output_dtype)

    def __str__(self) -> str:
        names = [_DTYPE_NAMES[d][0] if d in _DTYPE_NAMES else str(d) for d in
                 (self.param_dtype, self.compute_dtype, self.output_dtype)]
        return "p={},c={},o={}".format(*names)


def _parse_dtype(text: str, policy: str) -> torch.dtype:
    name = text.strip().lower()
    if name not in _NAME_TO_DTYPE:
        known = ", ".join(sorted(_NAME_TO_DTYPE))
        raise ValueError(
            f"get_policy: unknown dtype {text.strip()!r} in {policy!r}; known dtype names: "
            f"{known}. Fix: e.g. get_policy('params=float32,compute=bfloat16')."
        )
    return _NAME_TO_DTYPE[name]


def get_policy(policy: str) -> Policy:
    """Parse a policy string, with jmp's grammar and defaults.

    Either one dtype name for all three dtypes (``"bf16"``), or comma-separated
    ``key=dtype`` entries with keys ``params`` / ``p``, ``compute`` / ``c`` and
    ``output`` / ``o``. A missing ``params`` is float32, a missing ``compute`` follows
    ``params`` and a missing ``output`` follows ``compute``: ``"c=bf16"`` is
    ``p=f32,c=bf16,o=bf16``. Dtype names: ``float32`` / ``f32`` / ``full``, ``bfloat16`` /
    ``bf16``, ``float16`` / ``f16`` / ``half``, ``float64`` / ``f64``.

    Unlike jmp, ``half`` is always float16 (``torch.half``; jmp picks bfloat16 on TPUs),
    names and keys are read case-insensitively with spaces ignored around them, and a key
    given twice is an error (jmp keeps the last).

    Args:
        policy: the policy string.

    Returns:
        A [`Policy`][functopt.precision.Policy]; ``get_policy(str(policy)) == policy``.

    Raises:
        ValueError: for an unknown key or dtype name, an entry without ``=``, an empty
            entry or a key given twice.

    Examples:
        >>> from functopt.precision import get_policy
        >>> get_policy("params=float32,compute=bfloat16,output=float32")
        Policy(param_dtype=torch.float32, compute_dtype=torch.bfloat16, output_dtype=torch.float32)
        >>> print(get_policy("c=f16"))
        p=f32,c=f16,o=f16
        >>> print(get_policy("half"))
        p=f16,c=f16,o=f16
    """
    if not isinstance(policy, str):
        raise TypeError(
            f"get_policy: policy must be a string such as 'params=float32,compute=bfloat16', "
            f"got {type(policy).__name__} {policy!r}. Fix: build a Policy(...) directly from "
            f"torch dtypes."
        )
    if "=" not in policy:
        dtype = _parse_dtype(policy, policy)
        return Policy(dtype, dtype, dtype)
    given: dict[str, torch.dtype] = {}
    for part in policy.split(","):
        if "=" not in part:
            what = "an empty entry" if not part.strip() else f"the entry {part.strip()!r}"
            raise ValueError(
                f"get_policy: {what} in {policy!r} is not of the form key=dtype. Fix: "
                f"separate entries by single commas, e.g. 'p=f32,c=bf16,o=f32'."
            )
        key_text, value = part.split("=", 1)
        key = key_text.strip().lower()
        if key not in _KEYS:
            raise ValueError(
                f"get_policy: unknown key {key_text.strip()!r} in {policy!r}; keys are "
                f"'params' (or 'p'), 'compute' (or 'c') and 'output' (or 'o')."
            )
        field = _KEYS[key]
        if field in given:
            raise ValueError(
                f"get_policy: {field.removesuffix('_dtype')} dtype given twice in {policy!r}. "
                f"Fix: give each of params, compute and output at most once."
            )
        given[field] = _parse_dtype(value, policy)
    param = given.get("param_dtype", torch.float32)
    compute = given.get("compute_dtype", param)
    output = given.get("output_dtype", compute)
    return Policy(param, compute, output)
