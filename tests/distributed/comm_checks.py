"""Rank-side checks that each strategy's collectives per step are those of the formulas in
docs/sharded-state.md ("Communication per step"), at 2 and 4 gloo ranks.

Each check computes the prediction from the formula (collective count and the bytes each
collective takes in and gives out, from the leaves' sizes, the ranks N and the groups:
slices split like ``torch.chunk``) and compares it with what the
step does: the count from ``CommDebugMode`` and the bytes from a dispatch mode recording
every ``c10d`` operation's tensors. Nothing here reads functopt's own layout code.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import TorchDispatchMode

import functopt
from distributed.harness import check_registry, run_checks
from functopt.distributed import zero1, zero1_overlapped, zero1_reduce_scatter
from functopt.precision import mixed_precision

CHECKS, check = check_registry()

STATS_BYTES = 3 * 8  # [sum of squares, non-finite count, zero count] in float64


def run_all(rank: int, world: int) -> dict[str, str | None]:
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed.*")
    return run_checks(CHECKS, rank, world)


class _Recorder(TorchDispatchMode):
    """Every c10d operation dispatched: its name and the bytes of its tensor arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, list[int]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func)
        if name.startswith(("c10d.", "c10d_functional.")):
            sizes: list[int] = []
            for a in args:
                for t in a if isinstance(a, (list, tuple)) else [a]:
                    if isinstance(t, torch.Tensor):
                        sizes.append(t.numel() * t.element_size())
            self.ops.append((name.split(".")[1], sizes))
        return func(*args, **(kwargs or {}))


def _measure(fn: Any) -> tuple[int, list[tuple[str, list[int]]], Any]:
    with CommDebugMode() as comm, _Recorder() as rec:
        out = fn()
    return comm.get_total_counts(), rec.ops, out


def _chunk_lengths(numel: int, world: int) -> list[int]:
    """Each rank's slice length: torch.chunk's split, empty for the ranks past the end."""
    parts = [len(c) for c in torch.arange(numel).chunk(world)] if numel else []
    return parts + [0] * (world - len(parts))


def _gather_parts(leaves: list[torch.Tensor], world: int) -> list[int]:
    """s_l per leaf with elements: the longest rank's slice of it, in bytes (every rank
    hands that many to the leaf's gather, padded; the sum over the leaves is S)."""
    return [max(_chunk_lengths(p.numel(), world)) * p.element_size()
            for p in leaves if p.numel()]


def _coalesced_gather(parts: list[int], world: int) -> tuple[str, list[int]]:
    """The one coalesced all-gather of these parts: each leaf's N s_l out, s_l in."""
    return ("allgather_into_tensor_coalesced_", [world * s for s in parts] + parts)


def _params() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"a": torch.randn(5, 3).to(torch.bfloat16), "b": torch.randn(7),
            "c": torch.randn(3).to(torch.bfloat16), "d": torch.randn(4, 4),
            "e": torch.randn(1).to(torch.bfloat16)}


def _grads(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {k: torch.randn(p.shape, generator=g).to(p.dtype) for k, p in params.items()}


@check
def mixed_precision_over_a_mesh_is_one_all_reduce_of_24_bytes(rank: int, world: int) -> None:
    """FSDP2-like DTensor params: 1 collective of 3 float64, whatever the leaves; the peer
    pattern (a norm per DTensor leaf) makes L; torch's clip_grad_norm_ (2.13) makes 1 for
    the norm alone."""
    mesh = init_device_mesh("cpu", (world,))
    full = _params()
    params = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    grads = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in _grads(full).items()}
    opt = mixed_precision(functopt.adamw(1e-3), max_grad_norm=1.0)
    state = opt.init(params)
    count, ops, _ = _measure(lambda: opt.step(grads, state, params))
    assert count == 1 and ops == [("allreduce_", [STATS_BYTES])], ops
    leaves = list(grads.values())
    count, ops, _ = _measure(lambda: sum(torch.linalg.vector_norm(g).square() for g in leaves)
                             .full_tensor())
    assert count == len(leaves), ops  # one per leaf: L
    ps = [torch.nn.Parameter(p.detach().clone()) for p in params.values()]
    for p, g in zip(ps, leaves, strict=True):
        p.grad = g.detach().clone()
    count, _, _ = _measure(lambda: torch.nn.utils.clip_grad_norm_(ps, 1.0))
    assert count == 1, count


@check
def zero1_is_one_all_reduce_and_one_all_gather_of_s_bytes(rank: int, world: int) -> None:
    """zero1: the stats all_reduce (24 bytes) and one coalesced all_gather taking s_l bytes
    and giving N * s_l per leaf, s_l the longest rank's slice of leaf l; S = sum of s_l."""
    params = _params()
    opt = zero1(functopt.adamw(1e-3), max_grad_norm=1.0)
    state = opt.init(params)
    count, ops, _ = _measure(lambda: opt.step(_grads(params), state, params))
    parts = _gather_parts(list(params.values()), world)
    assert count == 2, ops
    assert ops == [("allreduce_", [STATS_BYTES]), _coalesced_gather(parts, world)], (ops, parts)
    # S is an even share of the param bytes, plus at most one element per leaf
    total = sum(p.numel() * p.element_size() for p in params.values())
    assert total / world <= sum(parts) <= total / world + sum(p.element_size()
                                                              for p in params.values())


@check
def zero1_overlapped_is_one_all_gather_per_leaf_on_gloo(rank: int, world: int) -> None:
    """zero1_overlapped on gloo: 1 + L collectives, one all-gather per leaf of the K buckets
    of consecutive leaves (sorted keys) whose slices stay within bucket_bytes (gloo's
    coalesced all-gathers are unsafe several at once); each leaf's N s_l out, s_l in."""
    params = _params()
    bucket = 24
    opt = zero1_overlapped(functopt.adamw(1e-3), bucket_bytes=bucket)
    state = opt.init(params)
    count, ops, _ = _measure(lambda: opt.step(_grads(params), state, params)[0].wait())
    buckets: list[list[torch.Tensor]] = []
    used = 0
    for key in sorted(params):  # the pytree's leaf order
        p = params[key]
        size = -(-p.numel() // world) * p.element_size()  # the longest rank's slice
        if not buckets or used + size > bucket:  # a new bucket when this one would overflow
            buckets.append([])
            used = 0
        buckets[-1].append(p)
        used += size
    parts = [_gather_parts(b, world) for b in buckets]
    assert len(buckets) > 1  # (several buckets in flight at once)
    assert count == 1 + sum(len(p) for p in parts), ops
    assert ops[0] == ("allreduce_", [STATS_BYTES])
    assert ops[1:] == [("_allgather_base_", [world * s, s]) for p in parts for s in p], (
        ops, parts)


@check
def zero1_reduce_scatter_is_one_per_dtype(rank: int, world: int) -> None:
    """zero1_reduce_scatter: G reduce_scatters (G gradient dtypes), each taking N * W_g
    elements and giving W_g, W_g the longest rank's sum of slice lengths of that dtype."""
    params = _params()
    grads = _grads(params)
    count, ops, _ = _measure(lambda: zero1_reduce_scatter(grads))
    expected = []
    for dtype in (torch.bfloat16, torch.float32):  # the leaves' first-seen order
        leaves = [g for k, g in sorted(grads.items()) if g.dtype == dtype]
        w = max(sum(_chunk_lengths(g.numel(), world)[r] for g in leaves) for r in range(world))
        size = torch.empty((), dtype=dtype).element_size()
        expected.append(("_reduce_scatter_base_", [w * size, world * w * size]))
    assert count == 2, ops
    assert ops == expected, (ops, expected)
    dist.barrier()
