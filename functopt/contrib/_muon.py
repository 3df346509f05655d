"""Muon: momentum orthogonalised by Newton-Schulz iterations (Jordan et al., 2024)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist

from functopt import _validate
from functopt._base import (
    EmptyState,
    GradientTransformation,
    Numeric,
    Params,
    ScalarOrSchedule,
    Updates,
)
from functopt._collective.dtensor import _infer_group, _leaf_names, is_dtensor
from functopt._collective.owners import assign_owners, gather_to_owners, scatter_from_owners
from functopt._rules import state_slots
from functopt._spec import PerLeaf, specified
from functopt.contrib import _shared
from functopt.optimizers import adamw
from functopt.transforms import _common
from functopt.transforms.adding import add_decayed_weights
from functopt.transforms.combining import chain
from functopt.transforms.partition import partition
from functopt.transforms.scaling import scale_by_learning_rate
from functopt.tree import _core

__all__ = ["MuonDimensionNumbers", "MuonState", "muon", "scale_by_muon"]

Preconditioning = Literal["frobenius", "spectral", "aol", "schatten"]
_PRECONDITIONINGS = ("frobenius", "spectral", "aol", "schatten")
_DEFAULT_NS_COEFFS = (3.4445, -4.7750, 2.0315)
# The five per-step coefficients of Dion (Ahn et al., 2025), optax's preset "dion".
_DION_NS_COEFFS = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)
_NS_PRESETS = {"standard": _DEFAULT_NS_COEFFS, "dion": _DION_NS_COEFFS}
# The first-step rescalings of 'aol' and 'schatten' floor their norms here (optax's
# constant, independent of the transform's eps).
_FIRST_STEP_EPS = 1e-8
# The most bytes of matrices the per-leaf tier stacks into one batched Newton-Schulz
# iteration, by device type. Each step of the iteration makes about four batch-sized
# buffers (X X^T, its square, their sum and the product with X, for a square matrix), read
# and written again by the next: on a CPU they stay in a core's L2 cache (1 MiB or more on
# current server cores) while the batch is at most a quarter of it, and a batch past that
# goes to memory on every pass. A matrix of a few hundred rows runs its products at full
# speed alone, so it gains nothing from a batch: small matrices are stacked up to 256 KiB
# and larger ones run one by one (measured: docs/performance.md). On an accelerator a
# batch saves kernel launches and larger batches are taken.
_BATCH_BYTES = {"cpu": 1 << 18}
_BATCH_BYTES_ELSEWHERE = 1 << 26


@dataclasses.dataclass(frozen=True)
class MuonDimensionNumbers:
    """Which axes of a weight are the matrix Muon orthogonalises.

    The weight is read as ``x @ W = y``: ``reduction_axis`` are the axes summed over (the
    rows of the matrix, fan-in), ``output_axis`` the output axes (the columns, fan-out).
    Every other axis is a batch axis: each slice along it is orthogonalised on its own.
    A frozen dataclass rather than optax's NamedTuple, so that a pytree of them is a tree of
    leaves (optree would flatten a NamedTuple); it is built and read the same way.

    Examples:
        >>> from functopt.contrib import MuonDimensionNumbers
        >>> conv = MuonDimensionNumbers(reduction_axis=(1, 2, 3), output_axis=0)  # (out, in, kh, kw)
        >>> conv.output_axis
        0
    """

    reduction_axis: Sequence[int] | int = 0
    output_axis: Sequence[int] | int = 1


WeightDimNumOrFn = Any
"""A ``MuonDimensionNumbers``, a pytree of them (``None`` where a leaf is not a matrix),
or ``updates -> such a pytree``."""


class MuonState(NamedTuple):
    """State of [`scale_by_muon`][functopt.contrib.scale_by_muon]."""

    # The name shadows tuple.count (hence the ignore); kept: optax's name, public API.
    count: torch.Tensor  # type: ignore[assignment]  # int32, shape (): updates done so far
    mu: Updates  # like params, dtype mu_dtype (default: the param's): EMA of the gradient
    ns_coeffs: torch.Tensor  # float64, shape (3,) or (steps, 3): Newton-Schulz coefficients


def _axes(value: Sequence[int] | int, ndim: int) -> tuple[int, ...]:
    items = (value,) if isinstance(value, int) else tuple(value)
    return tuple(a % ndim for a in items)


def _layout(shape: Sequence[int], dims: MuonDimensionNumbers,
            path: str) -> tuple[tuple[int, ...], tuple[int, int, int], int, int]:
    """The permutation to (batch, reduction, output), the 3-D shape, fan-in and fan-out."""
    ndim = len(shape)
    if ndim < 2:
        raise ValueError(
            f"muon: {path!r} has shape {tuple(shape)}; Muon orthogonalises matrices, so a leaf "
            f"it handles needs at least 2 dimensions. Fix: give this leaf None in the dimension "
            f"numbers (muon then updates it with Adam)."
        )
    reduction, output = _axes(dims.reduction_axis, ndim), _axes(dims.output_axis, ndim)
    if set(reduction) & set(output):
        raise ValueError(
            f"muon: {path!r}: the reduction axes {reduction} and output axes {output} overlap "
            f"(shape {tuple(shape)}). Fix: name each axis in at most one of them."
        )
    batch = tuple(a for a in range(ndim) if a not in reduction and a not in output)
    fan_in = math.prod(shape[a] for a in reduction)
    fan_out = math.prod(shape[a] for a in output)
    return (batch + reduction + output,
            (math.prod(shape[a] for a in batch), fan_in, fan_out), fan_in, fan_out)


def _newton_schulz_step(x: torch.Tensor, c: tuple[float, float, float], first: bool,
                        preconditioning: str) -> torch.Tensor:
    # One quintic step f(X) = c0 X + (c1 A + c2 A^2) X with A = X X^T. On the first step,
    # 'aol' rescales the rows by the root of A's absolute row sums and 'schatten' the whole
    # matrix by the root of A's Frobenius norm (A's Schatten-4 norm of X, squared).
    a = x @ x.mT
    if first and preconditioning == "aol":
        s = torch.rsqrt(torch.clamp(a.abs().sum(dim=-1), min=_FIRST_STEP_EPS)).unsqueeze(-1)
        x, a = x * s, a * s * s.mT
    elif first and preconditioning == "schatten":
        norm = torch.linalg.matrix_norm(a, ord="fro", keepdim=True)
        s = torch.rsqrt(torch.clamp(norm, min=_FIRST_STEP_EPS))
        x, a = x * s, a * (s * s)
    # b A + c A A and a X + B X as fused multiply-adds (one rounding each in a narrow dtype,
    # as torch.optim.Muon's bfloat16 iteration rounds)
    b = torch.baddbmm(a, a, a, beta=c[1], alpha=c[2])
    return torch.baddbmm(x, b, x, beta=c[0])


def _orthogonalize(x: torch.Tensor, rows: Sequence[tuple[float, float, float]],
                   preconditioning: str, eps: Any, clamp_norm: bool) -> torch.Tensor:
    """Newton-Schulz on a (batch, m, n) stack, one step per row of coefficients, in ``x``'s
    dtype (callers widen first); the norm divided by is ``norm + eps``, or
    ``max(norm, eps)`` with ``clamp_norm``."""
    # f(X) = f(X^T)^T: iterate on the side with the smaller Gram matrix, and a square
    # matrix as it is stored (its rows contiguous), as torch.optim.Muon iterates a weight
    m, n = x.shape[-2:]
    transposed = m > n or (m == n and not x.is_contiguous() and x.mT.is_contiguous())
    if transposed:
        x = x.mT
    eps_t = _common.scalar(eps, x.dtype)
    if preconditioning in ("frobenius", "spectral"):
        norm = torch.linalg.matrix_norm(x, ord="fro" if preconditioning == "frobenius" else 2,
                                        keepdim=True)
        x = x / (torch.clamp(norm, min=eps_t) if clamp_norm else norm + eps_t)
    if preconditioning in ("frobenius", "spectral") and _plain(x):
        x = _newton_schulz_into_buffers(x, rows)
    else:
        for i, row in enumerate(rows):
            x = _newton_schulz_step(x, row, i == 0, preconditioning)
    return x.mT if transposed else x


def _plain(x: torch.Tensor) -> bool:
    """Whether ``x`` is a plain tensor outside autograd and ``torch.func``'s transforms, so
    that the iteration's products may be written into buffers (``out=``)."""
    return (type(x) is torch.Tensor and not x.requires_grad
            and not torch._C._functorch.is_functorch_wrapped_tensor(x))


def _newton_schulz_into_buffers(x: torch.Tensor,
                                rows: Sequence[tuple[float, float, float]]) -> torch.Tensor:
    """`_newton_schulz_step` once per row (no first-step rescaling), each product written
    into buffers allocated once per call: the same operations, so the same bits, without
    fresh memory per product (on the CPU, each new page costs a fault on first touch)."""
    b, m, _ = x.shape
    gram, update = (x.new_empty((b, m, m)) for _ in range(2))
    buffers = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(2)]
    for i, c in enumerate(rows):
        torch.bmm(x, x.mT, out=gram)
        torch.baddbmm(gram, gram, gram, beta=c[1], alpha=c[2], out=update)
        x = torch.baddbmm(x, update, x, beta=c[0], out=buffers[i % 2])
    return x


def _resolve_dims(weight_dimension_numbers: Any, updates: Any, grads: list[Any],
                  treespec: _core.TreeSpec) -> list[Any]:
    """One ``MuonDimensionNumbers`` (or None) per leaf; None everywhere means the 2-D rule."""
    if weight_dimension_numbers is None:
        return [None if g is None else MuonDimensionNumbers() for g in grads]
    tree = (weight_dimension_numbers(updates) if callable(weight_dimension_numbers)
            else weight_dimension_numbers)
    try:
        dims = _core.broadcast_prefix(tree, updates, treespec)
    except ValueError as where:
        raise ValueError(
            f"scale_by_muon: weight_dimension_numbers does not line up with the updates "
            f"({where}). Fix: give a MuonDimensionNumbers, or a tree of them (None where a "
            f"leaf is not a matrix) with the params' structure or a prefix of it; a plain "
            f"tuple such as (0, 1) is read as a subtree: write MuonDimensionNumbers(0, 1)."
        ) from None
    for i, d in enumerate(dims):
        if d is not None and not isinstance(d, MuonDimensionNumbers):
            raise TypeError(
                f"scale_by_muon: weight_dimension_numbers at {_core.paths(treespec)[i]!r} is "
                f"{type(d).__name__} {d!r}; expected a MuonDimensionNumbers or None. Fix: use "
                f"functopt.contrib.MuonDimensionNumbers(reduction_axis=..., output_axis=...)."
            )
    return dims


def _ns_coefficients(owner: str, ns_coeffs: Any, ns_steps: int,
                     ) -> tuple[torch.Tensor, list[tuple[float, float, float]]]:
    """``ns_coeffs`` as a tensor (the state keeps it) and the coefficients of each of the
    ``ns_steps`` steps as Python numbers, once both are checked."""
    if not isinstance(ns_steps, int) or isinstance(ns_steps, bool) or ns_steps < 1:
        raise ValueError(f"{owner}: ns_steps must be an int >= 1, got {ns_steps!r}. "
                         f"Fix: 5 is usual.")
    if isinstance(ns_coeffs, str):
        if ns_coeffs not in _NS_PRESETS:
            raise ValueError(f"{owner}: unknown ns_coeffs preset {ns_coeffs!r}; the presets are "
                             f"{sorted(_NS_PRESETS)}. Fix: pass one of them or the numbers.")
        ns_coeffs = _NS_PRESETS[ns_coeffs]
    try:
        coeffs = torch.as_tensor(ns_coeffs, dtype=torch.float64)
    except (TypeError, ValueError):
        raise TypeError(f"{owner}: ns_coeffs must be three numbers or a tuple of such triples, "
                        f"got {ns_coeffs!r}.") from None
    if coeffs.dim() not in (1, 2) or coeffs.shape[-1] != 3:
        raise ValueError(f"{owner}: ns_coeffs must have shape (3,) or (n, 3), got "
                         f"{tuple(coeffs.shape)}. Fix: pass (a, b, c) or ((a, b, c), ...).")
    if coeffs.dim() == 2 and coeffs.shape[0] > ns_steps:
        raise ValueError(
            f"{owner}: {coeffs.shape[0]} rows of ns_coeffs but ns_steps={ns_steps}; with one "
            f"triple per step there must be at most ns_steps rows (each row is one step). "
            f"Fix: pass ns_steps={coeffs.shape[0]} or fewer rows.")
    listed = coeffs.tolist()
    return coeffs, [(float(a), float(b), float(c))
                    for a, b, c in ([listed] * ns_steps if coeffs.dim() == 1 else listed)]


def _check_matrices(grads: list[Any], dims: list[Any], present: list[int],
                    names: Callable[[int], str]) -> None:
    """Every leaf with a gradient has dimension numbers that fit its shape."""
    for i in present:
        if dims[i] is None:
            raise ValueError(
                f"scale_by_muon: {names(i)!r} has a gradient but no dimension "
                f"numbers (None). Fix: give it a MuonDimensionNumbers, or use muon(), "
                f"which updates such leaves with Adam.")
        _layout(grads[i].shape, dims[i], names(i))


def scale_by_muon(
    ns_coeffs: Any = _DEFAULT_NS_COEFFS,
    ns_steps: int = 5,
    beta: Numeric = 0.95,
    eps: Numeric = 1e-8,
    mu_dtype: torch.dtype | None = None,
    *,
    nesterov: bool = True,
    adaptive: bool = False,
    preconditioning: Preconditioning = "frobenius",
    weight_dimension_numbers: WeightDimNumOrFn | None = None,
    ns_dtype: torch.dtype | None = None,
    bias_correction: bool = True,
    clamp_norm: bool = False,
) -> GradientTransformation:
    r"""Rescale updates by Muon: orthogonalise the (Nesterov) momentum of each matrix.

    With $t$ counting from 1, $m_t = \beta m_{t-1} + (1-\beta) g_t$ and
    $\hat m_t = m_t/(1-\beta^t)$, or with ``nesterov``
    $\hat m_t = \beta m_t/(1-\beta^{t+1}) + (1-\beta) g_t/(1-\beta^t)$, the update is
    $u_t = \mathrm{NS}(\hat m_t) \approx U V^\top$ for $\hat m_t = U S V^\top$: the matrix
    is normalised (``preconditioning``: by its Frobenius or spectral norm; 'aol' and
    'schatten' rescale inside the first step instead) and then iterated ``ns_steps`` times
    with $X \leftarrow a X + (b A + c A^2) X$, $A = X X^\top$, on the side whose Gram matrix
    is smaller. ``ns_coeffs`` is one triple $(a, b, c)$ for every step or one triple per
    step (then at most ``ns_steps`` of them, and each row is one step, as in optax). With
    ``adaptive``, $u_t$ is scaled by $\langle \hat m_t, u_t\rangle$ (the dual norm).
    ``bias_correction=False`` drops the corrections ($\hat m_t = m_t$, or
    $\beta m_t + (1-\beta) g_t$ with ``nesterov``), and ``clamp_norm=True`` divides by
    $\max(\lVert X\rVert, \epsilon)$ instead of $\lVert X\rVert + \epsilon$: both as
    ``torch.optim.Muon`` and Keller Jordan's ``muon.py`` compute (which add or clamp, in
    that order); the Newton-Schulz input is normalised either way, so the corrections
    change only the weight of the gradient against the momentum under ``nesterov``.

    ``weight_dimension_numbers`` says which axes of each leaf form the matrix (see
    [`MuonDimensionNumbers`][functopt.contrib.MuonDimensionNumbers]); without it every leaf
    with a gradient must be 2-D. The maths runs in the widest of the leaf's dtypes and
    float32; the update keeps the gradient's dtype. With ``ns_dtype`` (``torch.bfloat16``,
    as ``torch.optim.Muon`` iterates) the momentum is kept and bias-corrected as without
    it, but the normalisation and the Newton-Schulz steps run in ``ns_dtype``: faster where
    the hardware multiplies bfloat16 matrices faster, and the update is then accurate to
    ``ns_dtype``'s rounding (the iteration only has to bring the singular values into a
    band, which bfloat16 does).

    On DTensor params (FSDP2's ``fully_shard``, tensor parallelism) the momentum stays
    sharded as the params are, and each matrix is orthogonalised whole on one rank: the
    shards travel to their owners in one all-to-all and the updates back in another, for
    all matrices together; the result is the single-process one ("Muon on sharded params"
    in the contrib guide gives the communication per step). A gradient must be present on
    every rank or on none: a rank cannot tell locally whether another rank has a
    gradient it lacks, and ranks with different sets wait in different exchanges until
    the process group's timeout.

    ``functopt.fast.make_step`` and the mixed-precision step run it on the planner's
    per-leaf tier: the momentum as ``foreach`` ops over a group of leaves and the
    Newton-Schulz iteration over batches of same-shape matrices stacked up to a size in
    bytes (a matrix of that size or more runs alone); the same maths as one matrix at a
    time.

    Args:
        ns_coeffs: Newton-Schulz coefficients: a triple, or a tuple of triples.
        ns_steps: the number of Newton-Schulz steps, >= 1.
        beta: decay of the momentum, in [0, 1).
        eps: added to the norm the matrix is divided by, >= 0.
        mu_dtype: storage dtype of the momentum (default: the param's dtype).
        nesterov: use Nesterov momentum.
        adaptive: scale by the dual norm of the momentum.
        preconditioning: 'frobenius', 'spectral', 'aol' or 'schatten'.
        weight_dimension_numbers: a `MuonDimensionNumbers`, a tree of them (None at leaves
            that are not updated here), or ``updates -> such a tree``.
        ns_dtype: the dtype of the Newton-Schulz iteration (default None: the momentum's
            compute dtype, float32 or wider), e.g. ``torch.bfloat16``.
        bias_correction: divide the momentum by $1 - \beta^t$ (optax's Muon).
        clamp_norm: normalise by $\max(\lVert X\rVert, \epsilon)$ (torch.optim.Muon).

    Returns:
        A [`GradientTransformation`][functopt.GradientTransformation] with
        [`MuonState`][functopt.contrib.MuonState].

    Examples:
        >>> import torch
        >>> from functopt import contrib
        >>> tx = contrib.scale_by_muon(ns_steps=10)
        >>> g = {"w": torch.tensor([[3.0, 0.0], [0.0, 0.5]])}
        >>> u, _ = tx.update(g, tx.init(g))
        >>> u["w"].diagonal()  # singular values 3 and 0.5 both brought into Muon's band
        tensor([1.0953, 0.6819])

    References:
        Jordan et al., *Muon: An optimizer for hidden layers in neural networks*, 2024.
        Bernstein & Newhouse, *Old Optimizer, New Norm: An Anthology*, 2024.
        Boissin et al., *Turbo-Muon* (AOL preconditioning), 2025.
        Grishina et al., *Accelerating Newton-Schulz Iteration for Orthogonalization via
        Chebyshev-type Polynomials*, 2025.
    """
    _validate.check_flags("scale_by_muon", nesterov=nesterov, adaptive=adaptive,
                          bias_correction=bias_correction, clamp_norm=clamp_norm)
    owner = "scale_by_muon"
    coeffs, rows = _ns_coefficients(owner, ns_coeffs, ns_steps)
    _common.check_betas(owner, beta=beta)
    _validate.check_range(owner, "eps", eps, low=0.0)
    _validate.check_dtype(owner, "mu_dtype", mu_dtype)
    _validate.check_dtype(owner, "ns_dtype", ns_dtype)
    if preconditioning not in _PRECONDITIONINGS:
        raise ValueError(f"{owner}: unknown preconditioning {preconditioning!r}; expected one "
                         f"of {list(_PRECONDITIONINGS)}.")

    def init_fn(params: Params) -> MuonState:
        leaves, treespec = _common.flatten_params(params)
        mu = [None if p is None else _common.zeros_like(p, mu_dtype) for p in leaves]
        return MuonState(count=_common.zero_count(leaves), mu=_common.unflatten(treespec, mu),
                         ns_coeffs=coeffs.to(_common.first_device(leaves)))

    def step(updates: Updates, state: MuonState, grouped: bool) -> tuple[Updates, MuonState]:
        _common.check_state("scale_by_muon", state, MuonState)
        grads, treespec = _common.flatten_updates(updates)
        mus = _common.state_like(treespec, state.mu, name="state.mu", like=grads)
        _common.check_state_present(owner, treespec, grads, mu=mus)
        dims = _resolve_dims(weight_dimension_numbers, updates, grads, treespec)
        count = _common.safe_increment(state.count)
        bc, bc_next = (_common.bias_correction(beta, count), _common.bias_correction(
            beta, _common.safe_increment(count))) if bias_correction else (None, None)
        names = _leaf_names(treespec)
        present = [i for i, g in enumerate(grads) if g is not None]
        _check_matrices(grads, dims, present, names)  # here, before any collective
        momentum = _momentum_grouped if grouped else _momentum
        mu_hats, new_mu = momentum([grads[i] for i in present], [mus[i] for i in present],
                                   beta, bc, bc_next, nesterov)
        out: list[Any] = [None] * len(grads)
        new_mus = list(mus)
        for i, m in zip(present, new_mu, strict=True):
            new_mus[i] = m
        sharded: list[int] = []  # leaves whose whole matrix lives on no single rank
        plain: list[int] = []
        for i, mu_hat in zip(present, mu_hats, strict=True):
            out[i] = mu_hat  # the sharded ones are replaced below, once all are known
            (sharded if is_dtensor(mu_hat) else plain).append(i)

        def orthogonalize(mu_hat: torch.Tensor, d: MuonDimensionNumbers,
                          dtype: torch.dtype) -> torch.Tensor:
            return _update_of(mu_hat, d, dtype, rows, preconditioning, eps, adaptive, ns_dtype,
                              clamp_norm)

        if grouped:
            for i, u in zip(plain, _updates_batched(
                    [out[i] for i in plain], [dims[i] for i in plain],
                    [grads[i].dtype for i in plain], rows, preconditioning, eps, adaptive,
                    ns_dtype, clamp_norm), strict=True):
                out[i] = u
        else:
            for i in plain:
                out[i] = orthogonalize(out[i], dims[i], grads[i].dtype)
        if sharded:
            _orthogonalize_sharded(out, grads, dims, sharded, names, orthogonalize)
        return _common.unflatten(treespec, out), MuonState(
            count=count, mu=_common.unflatten(treespec, new_mus), ns_coeffs=state.ns_coeffs)

    def update_fn(
        updates: Updates, state: MuonState, params: Params | None = None, **extra_args: Any
    ) -> tuple[Updates, MuonState]:
        del params, extra_args
        return step(updates, state, grouped=False)

    def grouped_fn(
        updates: Updates, state: MuonState, params: Params | None = None, **extra_args: Any
    ) -> tuple[Updates, MuonState]:
        # the planner's per-leaf tier: the same maths, the momentum with foreach ops and
        # Newton-Schulz batched over same-shape matrices
        del params, extra_args
        return step(updates, state, grouped=True)

    return specified(GradientTransformation(init_fn, update_fn), PerLeaf(
        "scale_by_muon", {"ns_steps": ns_steps, "beta": beta, "eps": eps, "nesterov": nesterov,
                          "adaptive": adaptive, "preconditioning": preconditioning,
                          "ns_dtype": ns_dtype, "bias_correction": bias_correction,
                          "clamp_norm": clamp_norm},
        slots=state_slots(MuonState), grouped=grouped_fn))


def _momentum(grads: list[torch.Tensor], mus: list[torch.Tensor], beta: Numeric, bc: Any,
              bc_next: Any, nesterov: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per leaf: the (Nesterov) bias-corrected momentum (uncorrected with ``bc`` None) in
    the widened dtype, and the new momentum in its own dtype."""
    hats, news = [], []
    for g, mu in zip(grads, mus, strict=True):
        wide = g.to(_common.compute_dtype(g.dtype, mu.dtype))
        # m + (1 - beta) (g - m): one pass, rounded as torch.optim.Muon's lerp_
        mu_t = torch.lerp(mu.to(wide.dtype), wide, _common.scalar(1 - beta, wide.dtype))
        if nesterov and bc is None:
            mu_hat = torch.lerp(wide, mu_t, _common.scalar(beta, wide.dtype))
        elif nesterov:
            mu_hat = (_common.scalar(beta, wide.dtype) * mu_t
                      / _common.scalar(bc_next, wide.dtype)
                      + _common.scalar(1 - beta, wide.dtype) * wide
                      / _common.scalar(bc, wide.dtype))
        elif bc is None:
            mu_hat = mu_t
        else:
            mu_hat = mu_t / _common.scalar(bc, wide.dtype)
        hats.append(mu_hat)
        news.append(mu_t.to(mu.dtype))
    return hats, news


def _momentum_grouped(grads: list[Any], mus: list[Any], beta: Numeric, bc: Any, bc_next: Any,
                      nesterov: bool) -> tuple[list[Any], list[Any]]:
    """`_momentum` with ``torch._foreach_*`` ops per (device, dtypes) group: the same
    elementwise operations in the same order, so the same bits."""
    hats: list[Any] = [None] * len(grads)
    news: list[Any] = [None] * len(grads)
    groups: dict[Any, list[int]] = {}
    for j, (g, mu) in enumerate(zip(grads, mus, strict=True)):
        if is_dtensor(g) or is_dtensor(mu):  # (sharded: the per-leaf maths, on DTensors)
            (hats[j],), (news[j],) = _momentum([g], [mu], beta, bc, bc_next, nesterov)
        else:
            groups.setdefault((g.device, g.dtype, mu.dtype), []).append(j)
    for (device, g_dtype, mu_dtype), idx in groups.items():
        dtype = _common.compute_dtype(g_dtype, mu_dtype)

        def s(value: Any, dtype: torch.dtype = dtype, device: Any = device) -> torch.Tensor:
            return torch.as_tensor(_common.scalar(value, dtype), dtype=dtype, device=device)

        wide = [grads[j].to(dtype) for j in idx]
        # (the weights as a list of 0-d tensors: a 0-d tensor as the Scalar weight would be
        # read back to the host)
        mu_t = torch._foreach_lerp([mus[j].to(dtype) for j in idx], wide,
                                   [s(1 - beta)] * len(idx))
        if nesterov and bc is None:
            mu_hat = torch._foreach_lerp(wide, mu_t, [s(beta)] * len(idx))
        elif nesterov:
            mu_hat = torch._foreach_add(
                torch._foreach_div(torch._foreach_mul(mu_t, s(beta)), s(bc_next)),
                torch._foreach_div(torch._foreach_mul(wide, s(1 - beta)), s(bc)))
        elif bc is None:
            mu_hat = mu_t
        else:
            mu_hat = torch._foreach_div(mu_t, s(bc))
        for j, hat, new in zip(idx, mu_hat, mu_t, strict=True):
            hats[j] = hat
            news[j] = new.to(mu_dtype)
    return hats, news


def _updates_batched(mu_hats: list[torch.Tensor], dims: list[Any], dtypes: list[torch.dtype],
                     rows: Sequence[tuple[float, float, float]], preconditioning: str,
                     eps: Any, adaptive: bool, ns_dtype: torch.dtype | None,
                     clamp_norm: bool) -> list[torch.Tensor]:
    """`_update_of` for many plain matrices: those whose (batch, m, n) views have the same
    (m, n), layout, dtype and device are stacked along the batch, up to ``_BATCH_BYTES``
    of them, and iterated together (one set of batched matrix products per batch instead
    of one per matrix)."""
    views = []
    shapes: dict[Any, list[int]] = {}
    for j, (mu_hat, d) in enumerate(zip(mu_hats, dims, strict=True)):
        order, flat_shape, _, _ = _layout(mu_hat.shape, d, "")
        permuted = mu_hat.permute(order)
        view = permuted.reshape(flat_shape)
        # stacked in the layout the matrices have (rows or columns contiguous), so that the
        # batched products read them as the single ones do
        columns = not view.is_contiguous() and view.mT.is_contiguous()
        views.append((order, permuted.shape, view))
        shapes.setdefault((flat_shape[1:], columns, mu_hat.dtype, mu_hat.device),
                          []).append(j)
    orthos: list[Any] = [None] * len(mu_hats)
    for (_, columns, _, _), idx in shapes.items():
        for chunk in _chunks([views[j][2] for j in idx], ns_dtype):
            stack = [views[idx[k]][2] for k in chunk]
            if len(stack) == 1:
                batch = stack[0]
            elif columns:
                batch = torch.cat([x.mT for x in stack]).mT
            else:
                batch = torch.cat(stack)
            result = _orthogonalize(_in_dtype(batch, ns_dtype), rows, preconditioning, eps,
                                    clamp_norm)
            for k, part in zip(chunk, torch.split(result, [x.shape[0] for x in stack]),
                               strict=True):
                orthos[idx[k]] = part
    out = []
    for (order, shape, _), ortho, mu_hat, dtype in zip(views, orthos, mu_hats, dtypes,
                                                         strict=True):
        out.append(_finish(ortho, order, shape, mu_hat, dtype, adaptive))
    return out


def _chunks(views: list[torch.Tensor], ns_dtype: torch.dtype | None) -> list[list[int]]:
    """The positions of ``views`` (same-shape stacks of matrices) in consecutive batches
    of at most ``_BATCH_BYTES`` (counted in the iteration's dtype); a view of that size or
    more is a batch of its own."""
    first = views[0]
    cap = _BATCH_BYTES.get(first.device.type, _BATCH_BYTES_ELSEWHERE)
    itemsize = (first.dtype if ns_dtype is None else ns_dtype).itemsize
    out: list[list[int]] = []
    size = 0
    for k, view in enumerate(views):
        nbytes = view.numel() * itemsize
        if not out or size + nbytes > cap:
            out.append([])
            size = 0
        out[-1].append(k)
        size += nbytes
    return out


def _in_dtype(x: torch.Tensor, ns_dtype: torch.dtype | None) -> torch.Tensor:
    return x if ns_dtype is None else x.to(ns_dtype)


def _finish(ortho: torch.Tensor, order: Sequence[int], shape: Sequence[int],
            mu_hat: torch.Tensor, dtype: torch.dtype, adaptive: bool) -> torch.Tensor:
    """An orthogonalised (batch, m, n) view back in the leaf's axes, scaled by the dual norm
    with ``adaptive``, in ``dtype``."""
    u = ortho.reshape(shape).permute(_inverse(order))
    if adaptive:
        u = torch.sum(mu_hat * u) * u
    return u.to(dtype)


def _update_of(mu_hat: torch.Tensor, d: MuonDimensionNumbers, dtype: torch.dtype,
               rows: Sequence[tuple[float, float, float]], preconditioning: str, eps: Any,
               adaptive: bool, ns_dtype: torch.dtype | None,
               clamp_norm: bool) -> torch.Tensor:
    """The update of one whole (plain) momentum matrix, in ``dtype``."""
    order, flat_shape, _, _ = _layout(mu_hat.shape, d, "")
    permuted = mu_hat.permute(order)
    ortho = _orthogonalize(_in_dtype(permuted.reshape(flat_shape), ns_dtype), rows,
                           preconditioning, eps, clamp_norm)
    return _finish(ortho, order, permuted.shape, mu_hat, dtype, adaptive)


def _ns_cost(shape: Sequence[int], d: MuonDimensionNumbers) -> float:
    """The multiply-adds of one Newton-Schulz step on a leaf (batch b of m x n, m <= n):
    b (2 m^2 n + m^3), the sizes of X X^T, A A and B X."""
    _, (b, m, n), _, _ = _layout(shape, d, "")
    m, n = min(m, n), max(m, n)
    return float(b * (2 * m * m * n + m ** 3))


def _orthogonalize_sharded(out: list[Any], grads: Sequence[Any], dims: Sequence[Any],
                           sharded: Sequence[int], names: Callable[[int], str],
                           orthogonalize: Callable[..., torch.Tensor]) -> None:
    """Replace each sharded momentum ``out[i]`` (i in ``sharded``) by its update.

    Each matrix is orthogonalised whole on one owner rank, the owners spread by the cost
    of the iteration; the shards travel to the owners in one all-to-all and the updates
    back in another (``functopt/_collective/owners.py``; the counts are in docs/contrib.md).
    """
    leaves = [out[i] for i in sharded]
    group = _infer_group(leaves, lambda j: names(sharded[j]))
    assert group is not None  # every leaf here is a DTensor
    owners = assign_owners([_ns_cost(x.shape, dims[i]) for x, i in zip(leaves, sharded,
                                                                      strict=True)],
                           dist.get_world_size(group))
    wholes = gather_to_owners(leaves, owners, names=lambda j: names(sharded[j]), group=group)
    values = [None if w is None else orthogonalize(w, dims[i], grads[i].dtype)
              for w, i in zip(wholes, sharded, strict=True)]
    updates = scatter_from_owners(values, leaves, owners, [grads[i].dtype for i in sharded],
                                  names=lambda j: names(sharded[j]), group=group)
    for i, u in zip(sharded, updates, strict=True):
        out[i] = u


def _inverse(order: Sequence[int]) -> tuple[int, ...]:
    inverse = [0] * len(order)
    for position, axis in enumerate(order):
        inverse[axis] = position
    return tuple(inverse)


def _scale_by_shape(weight_dimension_numbers: WeightDimNumOrFn | None,
                    consistent_rms: Numeric | None) -> GradientTransformation:
    """Muon's shape factor: $\\sqrt{\\max(1, \\text{fan\\_out}/\\text{fan\\_in})}$, or with
    ``consistent_rms`` $\\sqrt{\\max(\\text{fan\\_in}, \\text{fan\\_out})}\\cdot$ it."""

    def init_fn(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update_fn(updates: Updates, state: EmptyState, params: Params | None = None,
                  **extra_args: Any) -> tuple[Updates, EmptyState]:
        del params, extra_args
        grads, treespec = _common.flatten_updates(updates)
        dims = _resolve_dims(weight_dimension_numbers, updates, grads, treespec)
        out: list[Any] = []
        for i, (g, d) in enumerate(zip(grads, dims, strict=True)):
            if g is None or d is None:
                out.append(g)
                continue
            try:  # (the leaf's path only for the error: paths cost a walk of the tree)
                _, _, fan_in, fan_out = _layout(g.shape, d, "")
            except ValueError:
                _layout(g.shape, d, _core.paths(treespec)[i])
                raise
            if consistent_rms is not None:
                factor: Any = math.sqrt(max(fan_in, fan_out)) * consistent_rms
            else:  # an empty matrix has no width to transfer: its (empty) update stays
                factor = math.sqrt(max(1.0, fan_out / fan_in)) if fan_in else 1.0
            # (a factor of exactly 1, a square or wide matrix's, leaves every bit as it is)
            out.append(g if factor == 1.0 else _common.scaled(g, factor))
        return _common.unflatten(treespec, out), state

    # a per-leaf factor of the leaf's shape: not elementwise over leaves laid end to end
    return specified(GradientTransformation(init_fn, update_fn), PerLeaf(
        "muon_shape_factor", {"consistent_rms": consistent_rms}, slots=state_slots(EmptyState)))


def muon(
    learning_rate: ScalarOrSchedule,
    ns_coeffs: Any = _DEFAULT_NS_COEFFS,
    ns_steps: int = 5,
    beta: Numeric = 0.95,
    eps: Numeric = 1e-8,
    weight_decay: Numeric = 0.0,
    weight_decay_mask: Any | Callable[[Params], Any] | None = None,
    mu_dtype: torch.dtype | None = None,
    *,
    nesterov: bool = True,
    adaptive: bool = False,
    preconditioning: Preconditioning = "frobenius",
    adam_b1: Numeric = 0.9,
    adam_b2: Numeric = 0.999,
    adam_eps_root: Numeric = 0.0,
    adam_weight_decay: Numeric = 0.0,
    adam_learning_rate: ScalarOrSchedule | None = None,
    muon_weight_dimension_numbers: WeightDimNumOrFn | None = None,
    consistent_rms: Numeric | None = None,
    ns_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    r"""Muon for the matrices, AdamW for the rest: optax's ``muon`` recipe.

    A [`partition`][functopt.partition] of two chains. The matrices (every 2-D leaf, or the
    leaves with a `MuonDimensionNumbers` in ``muon_weight_dimension_numbers``) get
    ``chain(scale_by_muon(...), shape factor, add_decayed_weights(weight_decay,
    weight_decay_mask), scale_by_learning_rate(learning_rate))``, where the shape factor is
    $\sqrt{\max(1, \text{fan\_out}/\text{fan\_in})}$ (or, with ``consistent_rms`` $r$,
    $r\sqrt{\max(\text{fan\_in}, \text{fan\_out})}$, which gives updates AdamW's RMS for
    $r \approx 0.2$). The other leaves (None in the dimension numbers) get
    ``adamw(adam_learning_rate or learning_rate, adam_b1, adam_b2, eps, adam_eps_root,
    weight_decay=adam_weight_decay, nesterov=nesterov)``. ``ns_coeffs`` may also name a
    preset: 'standard' or 'dion'; ``ns_dtype=torch.bfloat16`` runs the Newton-Schulz
    iteration in bfloat16. See [`scale_by_muon`][functopt.contrib.scale_by_muon].

    A callable ``muon_weight_dimension_numbers`` is called with the params in ``init`` and
    with the updates (None where a leaf has no gradient) in ``update``.

    **PyTorch modules.** The defaults are optax's, which reads a 2-D leaf as ``(in, out)``
    (``x @ W``). ``torch.nn.Linear`` stores ``(out, in)``: for its weights pass
    ``MuonDimensionNumbers(reduction_axis=1, output_axis=0)``, else the shape factor
    swaps fan-in and fan-out (the orthogonalisation is the same either way). Muon's authors
    update embeddings and output heads with AdamW: give those leaves None. For the
    ``dict(model.named_parameters())`` of a model whose embedding and head names start
    with ``embed`` and ``lm_head``, one line does both::

        dims = lambda p: {k: contrib.MuonDimensionNumbers(1, 0) if v is not None and
                          v.dim() == 2 and not k.startswith(("embed", "lm_head")) else None
                          for k, v in p.items()}
        opt = contrib.muon(0.02, muon_weight_dimension_numbers=dims)

    (``v`` is None where a leaf has no gradient.) The Adam leaves take ``nesterov`` too, as
    in optax's recipe.

    Examples:
        >>> import torch
        >>> from functopt import contrib
        >>> opt = contrib.muon(0.02)
        >>> params = {"w": torch.ones(4, 3), "b": torch.zeros(3)}
        >>> state = opt.init(params)
        >>> u, state = opt.update({"w": torch.randn(4, 3), "b": torch.ones(3)}, state, params)
        >>> u["b"]  # the 1-D leaf takes Nesterov AdamW's first step: -1.474 lr sign(g)
        tensor([-0.0295, -0.0295, -0.0295])
        >>> bool(torch.linalg.matrix_norm(u["w"], ord=2) < 0.03)  # the matrix: about lr * U V^T
        True
    """
    _validate.check_flags("muon", nesterov=nesterov, adaptive=adaptive)
    owner = "muon"
    _shared.check_lr(owner, learning_rate)
    if adam_learning_rate is None:
        adam_learning_rate = learning_rate
    _shared.check_lr(owner, adam_learning_rate)
    _validate.check_number(owner, "weight_decay", weight_decay)
    if consistent_rms is not None:
        _validate.check_number(owner, "consistent_rms", consistent_rms)
    coeffs = (_NS_PRESETS[ns_coeffs] if isinstance(ns_coeffs, str) and ns_coeffs in _NS_PRESETS
              else ns_coeffs)
    dims = muon_weight_dimension_numbers

    def labels(tree: Any) -> Any:
        leaves, treespec = _core.flatten(tree)
        if dims is None:
            flat = [None if x is None else ("muon" if x.dim() == 2 else "adam") for x in leaves]
        else:
            resolved = _resolve_dims(dims, tree, leaves, treespec)
            flat = [None if x is None else ("adam" if d is None else "muon")
                    for x, d in zip(leaves, resolved, strict=True)]
        return _core.unflatten(treespec, flat)

    return partition(
        transforms={
            "muon": chain(
                scale_by_muon(ns_coeffs=coeffs, ns_steps=ns_steps, beta=beta, eps=eps,
                              mu_dtype=mu_dtype, nesterov=nesterov, adaptive=adaptive,
                              preconditioning=preconditioning, weight_dimension_numbers=dims,
                              ns_dtype=ns_dtype),
                _scale_by_shape(dims, consistent_rms),
                add_decayed_weights(weight_decay, weight_decay_mask),
                scale_by_learning_rate(learning_rate),
            ),
            "adam": adamw(adam_learning_rate, b1=adam_b1, b2=adam_b2, eps=eps,
                          eps_root=adam_eps_root, weight_decay=adam_weight_decay,
                          mu_dtype=mu_dtype, nesterov=nesterov),
        },
        param_labels=labels,
    )
