"""torch.optim.Adafactor as a functopt transform and drop-in class."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch

from functopt._base import GradientTransformation, Params, Updates
from functopt._collective.dtensor import is_dtensor
from functopt.adapters._torch_state import TorchLayout
from functopt.optim import _base, _chains
from functopt.transforms import _common
from functopt.transforms.combining import chain
from functopt.transforms.factored import _BATCH_ELEMENTS_ELSEWHERE

__all__ = ["Adafactor"]

# The extra argument with which the drop-in's step asks the rule to add each run's updates
# into its params as it goes (`Adafactor`).
IN_PLACE = "apply_updates_in_place"

# The most elements in one run of leaves on the CPU: its passes (about a dozen, over the
# gradients, the params and the update) stay in cache. Measured on two threads of an AVX2
# CPU with the drop-in's in-place step (medians of 11; torch's loop beside it): 2**18 53 ms,
# 2**19 48, 2**20 47, 2**21 49 (torch 45) on 50 matrices of 512x512 and 50 vectors; 17.7,
# 15.9, 15.7 and 15.8 ms (torch 14.9) on a small transformer's 3.2M params.
_RUN_ELEMENTS = {"cpu": 1 << 20}


class TorchAdafactorState(NamedTuple):
    """State of torch.optim.Adafactor's rule, with torch's shapes (``keepdim`` statistics).

    A leaf with two or more dims keeps ``row_var`` (its shape with the last dim 1) and
    ``col_var`` (its shape with the second last dim 1), and None as ``variance``; any other
    leaf keeps ``variance`` (its shape) and None as the two factors.
    """

    # The name shadows tuple.count (hence the ignore): the name of every functopt count.
    count: torch.Tensor  # type: ignore[assignment]  # int32, shape (): updates done so far
    row_var: Updates  # EMA of the mean over the last dim of g**2 (None for vectors)
    col_var: Updates  # EMA of the mean over the second last dim of g**2 (None for vectors)
    variance: Updates  # EMA of g**2 for leaves of at most one dim (None for the others)


class _Scalars(NamedTuple):
    """The step's scalars: 0-d float64 tensors, and the hyperparameters as given."""

    weight: torch.Tensor  # 1 - beta2_t = t ** beta2_decay: the EMAs' lerp weight
    rho: torch.Tensor  # min(lr, 1 / sqrt(t))
    decay: Any  # lr * weight_decay, or None
    d: Any
    eps1: float | None
    eps2: Any


def _eps1(s: _Scalars, dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps if s.eps1 is None else s.eps1


def _scales(param_norms: torch.Tensor, update_norms: torch.Tensor, roots: Any,
            s: _Scalars) -> torch.Tensor:
    """Each leaf's factor: alpha = max(eps2, rms(p)) rho_t over max(1, rms(u) / d), negated
    (float64, as torch's Python floats)."""
    alpha = torch.clamp(param_norms.to(torch.float64) / roots, min=s.eps2) * s.rho
    return -alpha / torch.clamp(update_norms.to(torch.float64) / roots / s.d, min=1.0)


def _leaf(g: torch.Tensor, p: torch.Tensor, row: Any, col: Any, var: Any,
          s: _Scalars) -> tuple[torch.Tensor, Any, Any, Any]:
    """One leaf's ``(update, row_var, col_var, variance)`` (see ``scale_by_torch_adafactor``),
    each operation making a new tensor (the form autograd and DTensors take); `_grouped` is
    the same operations, in place and over lists."""
    dtype = g.dtype
    e1 = _eps1(s, p.dtype)
    w = _common.scalar(s.weight, dtype)
    if g.dim() > 1:
        row_norm = torch.linalg.vector_norm(g, dim=-1, keepdim=True)
        col_norm = torch.linalg.vector_norm(g, dim=-2, keepdim=True)
        row = torch.lerp(row, row_norm * row_norm / g.shape[-1], w)
        col = torch.lerp(col, col_norm * col_norm / g.shape[-2], w)
        a = torch.rsqrt(row / row.mean(dim=-2, keepdim=True).clamp_min(e1))
        b = torch.rsqrt(col)
        u = g * a * b
        if e1 > 0:
            u = torch.where(a * b > 1 / e1, g * (1 / e1), u)
    else:
        var = torch.lerp(var, g * g, w)
        u = var.clamp_min(e1 * e1).rsqrt() * g
    root = max(g.numel(), 1) ** 0.5
    scale = _scales(torch.linalg.vector_norm(p), torch.linalg.vector_norm(u), root, s)
    u = u * _common.scalar(scale, dtype)
    if s.decay is not None:
        c = _common.scalar(-s.decay, dtype)
        u = torch.addcmul(u, p, c) if isinstance(c, torch.Tensor) else torch.add(u, p, alpha=c)
    return u, row, col, var


def _floored(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], e1: float) -> list[int]:
    """The leaves where ``a b`` exceeds ``1 / e1`` somewhere (the floor ``e1**2`` of the
    variance estimate is met there: rows or columns of zero gradients), or holds a nan;
    every leaf when the peaks cannot be read without a host sync being recorded."""
    if e1 <= 0:
        return []
    if torch.compiler.is_compiling() or (
            a[0].is_cuda and torch.cuda.is_current_stream_capturing()):
        return list(range(len(a)))
    full = [k for k in range(len(a)) if a[k].numel() and b[k].numel()]  # (no max of nothing)
    if not full:
        return []
    peaks = (torch.stack(torch._foreach_max([a[k] for k in full]))
             * torch.stack(torch._foreach_max([b[k] for k in full])))
    return [k for k, ok in zip(full, (peaks <= 1 / e1).tolist(), strict=True) if not ok]


def _grouped(gs: list[torch.Tensor], ps: list[torch.Tensor], rows: list[Any], cols: list[Any],
             variances: list[Any], s: _Scalars) -> tuple[list[Any], ...]:
    """`_leaf` over leaves of one device and dtype, with foreach operations (each one the
    per-leaf operation, so the same bits) and in place on the step's own temporaries."""
    dtype = gs[0].dtype
    e1 = _eps1(s, ps[0].dtype)
    w = _common.scalar(s.weight, dtype)
    out: list[Any] = [None] * len(gs)
    rows, cols, variances = list(rows), list(cols), list(variances)
    mats = [j for j, g in enumerate(gs) if g.dim() > 1]
    vecs = [j for j, g in enumerate(gs) if g.dim() <= 1]
    if mats:
        mg = [gs[j] for j in mats]
        row_norm = [torch.linalg.vector_norm(g, dim=-1, keepdim=True) for g in mg]
        col_norm = [torch.linalg.vector_norm(g, dim=-2, keepdim=True) for g in mg]
        torch._foreach_mul_(row_norm, row_norm)
        torch._foreach_div_(row_norm, [g.shape[-1] for g in mg])
        torch._foreach_mul_(col_norm, col_norm)
        torch._foreach_div_(col_norm, [g.shape[-2] for g in mg])
        new_rows = torch._foreach_lerp([rows[j] for j in mats], row_norm, w)
        new_cols = torch._foreach_lerp([cols[j] for j in mats], col_norm, w)
        means = [r.mean(dim=-2, keepdim=True) for r in new_rows]
        torch._foreach_clamp_min_(means, e1)
        a = torch._foreach_div(new_rows, means)
        torch._foreach_rsqrt_(a)
        b = torch._foreach_rsqrt(new_cols)
        u = list(torch._foreach_mul(mg, a))
        torch._foreach_mul_(u, b)
        for k in _floored(a, b, e1):
            u[k] = torch.where(a[k] * b[k] > 1 / e1, mg[k] * (1 / e1), u[k])
        for k, j in enumerate(mats):
            out[j], rows[j], cols[j] = u[k], new_rows[k], new_cols[k]
    if vecs:
        vg = [gs[j] for j in vecs]
        new_vars = torch._foreach_lerp([variances[j] for j in vecs], torch._foreach_mul(vg, vg), w)
        inv = torch._foreach_clamp_min(new_vars, e1 * e1)
        torch._foreach_rsqrt_(inv)
        torch._foreach_mul_(inv, vg)
        for k, j in enumerate(vecs):
            out[j], variances[j] = inv[k], new_vars[k]
    roots = torch.tensor([max(g.numel(), 1) ** 0.5 for g in gs], dtype=torch.float64,
                         device=gs[0].device)
    scale = _scales(torch.stack(torch._foreach_norm(ps)), torch.stack(torch._foreach_norm(out)),
                    roots, s)
    torch._foreach_mul_(out, list(_common.scalar(scale, dtype).unbind(0)))
    if s.decay is not None:
        c = _common.scalar(-s.decay, dtype)
        if isinstance(c, torch.Tensor):
            torch._foreach_addcmul_(out, ps, [c] * len(ps))
        else:
            torch._foreach_add_(out, ps, alpha=c)
    return out, rows, cols, variances


def scale_by_torch_adafactor(
    learning_rate: Any, beta2_decay: Any, d: Any, weight_decay: Any = None, *,
    eps1: float | None = None, eps2: Any = 1e-3,
) -> GradientTransformation:
    r"""torch.optim.Adafactor's update, whole: ``params + update`` is torch's new param.

    With $t$ the step (from 1), $\hat\beta_t = 1 - t^{\tau}$ ($\tau$ = ``beta2_decay``),
    $\rho_t = \min(\gamma, 1/\sqrt t)$ and $\epsilon_1$ the param dtype's machine epsilon
    when None: a leaf $G$ of two or more dims keeps the row and column means of $G^2$ over
    its last two dims, $R_t$ and $C_t$ (EMAs with weight $1 - \hat\beta_t$), and
    $\hat V_t = R_t C_t / \max(\text{mean}(R_t), \epsilon_1)$; any other leaf keeps the EMA
    $\hat V_t$ of $G^2$. Then $U = G / \sqrt{\max(\hat V_t, \epsilon_1^2)}$ and the update is
    $-\alpha\,U / \max(1, \text{rms}(U)/d) - \gamma\lambda\theta$ with
    $\alpha = \max(\epsilon_2, \text{rms}(\theta))\,\rho_t$ (``weight_decay`` None: no
    decay term). Reads the params.
    """

    def init_fn(params: Params) -> TorchAdafactorState:
        leaves, treespec = _common.flatten_params(params)

        def zeros(leaf: Any, keep: int | None) -> Any:
            if not isinstance(leaf, torch.Tensor):
                return None
            if keep is None:
                return torch.zeros_like(leaf) if leaf.dim() <= 1 else None
            if leaf.dim() <= 1:
                return None
            shape = list(leaf.shape)
            shape[keep] = 1
            return leaf.new_zeros(shape)

        return TorchAdafactorState(
            count=_common.zero_count(leaves),
            row_var=_common.unflatten(treespec, [zeros(x, -1) for x in leaves]),
            col_var=_common.unflatten(treespec, [zeros(x, -2) for x in leaves]),
            variance=_common.unflatten(treespec, [zeros(x, None) for x in leaves]),
        )

    def update_fn(updates: Updates, state: TorchAdafactorState, params: Params | None = None,
                  **extra_args: Any) -> tuple[Updates, TorchAdafactorState]:
        owner = "functopt.optim.Adafactor"
        _common.check_state(owner, state, TorchAdafactorState)
        # (the drop-in's step: each run's updates added into its params while they are in
        # cache, see Adafactor; the updates are returned all the same)
        in_place = bool(extra_args.get(IN_PLACE, False))
        if params is None:
            raise ValueError(f"{owner}: update needs the params (Adafactor scales each update "
                             f"by its param's RMS). Fix: pass params to update.")
        grads, treespec = _common.flatten_updates(updates)
        _common.check_params_structure(owner, treespec, params)
        ps = _common.flatten_params(params)[0]
        rows = _common.state_like(treespec, state.row_var, name="state.row_var", like=grads)
        cols = _common.state_like(treespec, state.col_var, name="state.col_var", like=grads)
        variances = _common.state_like(treespec, state.variance, name="state.variance",
                                       like=grads)
        count = _common.safe_increment(state.count)
        t = count.to(torch.float64)
        weight = t ** _common.scalar(beta2_decay, torch.float64)
        rho = torch.clamp(1.0 / t.sqrt(), max=_common.scalar(learning_rate, torch.float64))
        scalars = _Scalars(weight, rho, None if weight_decay is None else
                           learning_rate * weight_decay, d, eps1, eps2)
        out: list[Any] = [None] * len(grads)
        new = (list(rows), list(cols), list(variances))
        # Under autograd (or over DTensors) leaf by leaf, making new tensors; else per
        # device and dtype with foreach operations in place on the step's temporaries.
        batches: dict[Any, list[int]] = {}
        by_leaf = torch.is_grad_enabled()
        for j, g in enumerate(grads):
            if g is None:
                continue
            if by_leaf or is_dtensor(g) or is_dtensor(ps[j]):
                out[j], new[0][j], new[1][j], new[2][j] = _leaf(
                    g, ps[j], rows[j], cols[j], variances[j], scalars)
                if in_place:
                    with torch.no_grad():
                        ps[j].add_(out[j])
            else:
                batches.setdefault((g.device, g.dtype, ps[j].dtype), []).append(j)
        for idx in _chunked(batches.values(), grads):
            made = _grouped([grads[j] for j in idx], [ps[j] for j in idx],
                            [rows[j] for j in idx], [cols[j] for j in idx],
                            [variances[j] for j in idx], scalars)
            if in_place:
                with torch.no_grad():
                    torch._foreach_add_([ps[j] for j in idx], made[0])
            for k, j in enumerate(idx):
                out[j], new[0][j], new[1][j], new[2][j] = (x[k] for x in made)
        return _common.unflatten(treespec, out), TorchAdafactorState(
            count, *(_common.unflatten(treespec, leaves) for leaves in new))

    return GradientTransformation(init_fn, update_fn)


def _chunked(batches: Iterable[list[int]], grads: list[Any]) -> list[list[int]]:
    """Each batch cut into runs of at most ``_RUN_ELEMENTS`` elements on the CPU (a run
    whose passes stay in cache: one pass over many large leaves goes to memory each time,
    slower than leaf by leaf), whole elsewhere (where a pass costs a kernel launch)."""
    out: list[list[int]] = []
    for idx in batches:
        g = grads[idx[0]]
        cap = _RUN_ELEMENTS.get(g.device.type, _BATCH_ELEMENTS_ELSEWHERE)
        run: list[int] = []
        size = 0
        for j in idx:
            n = grads[j].numel()
            if run and size + n > cap:
                out.append(run)
                run, size = [], 0
            run.append(j)
            size += n
        out.append(run)
    return out


class Adafactor(_base.TorchOptimizer):
    r"""``torch.optim.Adafactor`` as a functopt transform: the same signature, defaults,
    state dict and numerics.

    torch's variant of Adafactor (Shazeer & Stern 2018): every param of two or more dims is
    factored over its last two dims, $\epsilon_1$ (None: the param dtype's machine epsilon)
    floors the variance estimate and the row factors' mean, the relative step is
    $\rho_t = \min(\text{lr}, 1/\sqrt t)$ times $\max(\epsilon_2, \text{rms}(\theta))$, the
    update's RMS is clipped to ``d`` and the weight decay is decoupled,
    $\theta \leftarrow \theta(1 - \text{lr}\,\lambda)$. ``functopt.adafactor`` is optax's
    variant (factoring the two largest dims of large enough params, $\epsilon$ added to
    $g^2$, no relative step).

    ``lr``, ``beta2_decay``, ``d`` and ``weight_decay`` live in ``param_groups``
    (schedulers move them; a ``weight_decay`` of 0 in the constructor and every group has
    no stage); a group may set its own ``eps`` and ``maximize`` (it runs its own chain).
    The state dict is torch's (``step``, and ``row_var`` and ``col_var`` or ``variance``
    per param): it loads into ``torch.optim.Adafactor``, and torch's loads here. The rule
    runs with ``foreach`` operations over runs of leaves (each run small enough to stay in
    cache on the CPU), in place on its own temporaries, adds each run's updates into its
    params as soon as they are made, and reads one value back to the host per step
    (whether some matrix meets the floor of its variance estimate); under autograd it
    makes every tensor anew, so gradients flow through ``opt.transform``'s update.

    Examples:
        >>> import torch, functopt
        >>> w, t = torch.nn.Parameter(torch.ones(3, 2)), torch.nn.Parameter(torch.ones(3, 2))
        >>> opt, ref = functopt.optim.Adafactor([w]), torch.optim.Adafactor([t])
        >>> w.grad = torch.tensor([[3.0, 0.0], [0.0, 0.5], [1.0, 1.0]])
        >>> t.grad = w.grad.clone()
        >>> opt.step()
        >>> ref.step()
        >>> bool((w - t).abs().max() < 1e-6)
        True
    """

    _differentiable_key = False
    # The rule adds each run's updates into its params (a run of leaves small enough to
    # stay in cache on the CPU) as torch's loop adds each param's, instead of all of them
    # after the rule: the same additions, one pass over memory fewer.
    _in_place_argument = IN_PLACE
    _sparse_words = "Adafactor does not support sparse gradients"
    _complex_words = "Adafactor does not support complex parameters"
    _torch_layout = TorchLayout({"row_var": ("TorchAdafactorState.row_var",),
                                 "col_var": ("TorchAdafactorState.col_var",),
                                 "variance": ("TorchAdafactorState.variance",)})

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 1e-2,
        beta2_decay: float = -0.8,
        eps: tuple[float | None, float] = (None, 1e-3),
        d: float = 1.0,
        weight_decay: float = 0.0,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        compile: bool = False,
    ) -> None:
        owner = "functopt.optim.Adafactor"
        _base.check_options(owner, foreach=foreach, maximize=maximize)
        if compile:
            raise ValueError(
                f"{owner}: compile=True, but the class's rule adds its updates into the "
                f"params run by run, which the compiled tier does not lower: no step of it "
                f"would be compiled. Fix: leave compile=False: the class steps on its own "
                f"foreach path.")
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError(f"{owner}: Tensor lr must be 1-element, got shape "
                             f"{tuple(lr.shape)}. Fix: pass a float or a 0-d tensor.")
        value = _base.number(owner, "lr", lr)
        _base.check(owner, value >= 0.0, f"Learning rate should be >= 0 but is: {lr}",
                    "lr >= 0")
        decay = _base.number(owner, "beta2_decay", beta2_decay)
        _base.check(owner, decay <= 0.0, f"beta2_decay should be <= 0 but is: {beta2_decay}",
                    "beta2_decay <= 0: beta2_t = 1 - t**beta2_decay")
        if not isinstance(eps, (tuple, list)) or len(eps) != 2:
            raise TypeError(f"{owner}: eps must be a pair (eps1, eps2), eps1 None or a "
                            f"number, got {eps!r}. Fix: the default is (None, 1e-3).")
        eps1 = None if eps[0] is None else _base.number(owner, "eps[0]", eps[0])
        eps2 = _base.number(owner, "eps[1]", eps[1])
        _base.check(owner, eps1 is None or eps1 >= 0.0,
                    f"epsilon1 should be >= 0 but is: {eps[0]}", "eps[0] >= 0 or None")
        _base.check(owner, eps2 >= 0.0, f"epsilon2 should be >= 0 but is: {eps[1]}",
                    "eps[1] >= 0")
        _base.check(owner, _base.number(owner, "d", d) >= 1.0,
                    f"Clipping threshold d should be >= 1 but is: {d}", "d >= 1")
        _base.check(owner, _base.number(owner, "weight_decay", weight_decay) >= 0.0,
                    f"weight_decay should be >= 0 but is: {weight_decay}", "weight_decay >= 0")
        params = _base.listed(params)
        hyper: dict[str, Any] = {"learning_rate": lr, "beta2_decay": beta2_decay, "d": d}
        fixed: dict[str, Any] = {"eps": eps, "foreach": foreach, "maximize": maximize}
        values = [weight_decay, *_base.groups_set(params, "weight_decay")]
        if any(_base.number(owner, "weight_decay", v) != 0 for v in values):
            hyper["weight_decay"] = weight_decay
        else:
            fixed["weight_decay"] = weight_decay
        flags = {"eps1": eps1, "eps2": eps2, "maximize": maximize}
        super().__init__(params, adafactor, hyper, flags, fixed, lowerable=False,
                         fused=None, differentiable=False, compile=compile)


def adafactor(learning_rate: Any, beta2_decay: Any, d: Any, weight_decay: Any = None, *,
               eps1: float | None = None, eps2: float = 1e-3,
               maximize: bool = False) -> GradientTransformation:
    """torch.optim.Adafactor: ``[scale(-1)], scale_by_torch_adafactor``."""
    rule = scale_by_torch_adafactor(learning_rate, beta2_decay, d, weight_decay,
                                    eps1=eps1, eps2=eps2)
    return chain(*_chains._stages(maximize, None, rule))
