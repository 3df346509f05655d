r"""The mixed-precision step on fused kernels: the same step in four passes over memory.

[`mixed_precision`][functopt.precision.mixed_precision] takes this path when the step
planner (``functopt/fast/_planner.py``) lowers its inner transform, however composed
(``adamw``, ``chain(clip_by_global_norm(1.0), adamw(...))``, a masked or partitioned
chain, an injected recipe), and the masters are plain copies
([`float32_master`][functopt.precision.float32_master]). Per step, over the gradients'
and the masters' bytes:

1. one cast of the gradients to the masters' precision (``torch._foreach_copy_``, into
   the previous step's buffers when the step is donated), but for the groups whose
   compiled call reads the low-precision gradients itself (off the CPU:
   ``_compiled.reads_as_given``);
2. one read of the casts: each leaf's norm (``torch._foreach_norm``), times
   ``1 / loss_scale``, gives the statistics and the sums of squares of every clip of the
   inner chain, and one all-reduce of them packed together makes them global (the zero
   count, when asked for, is a second read);
3. the fused kernels, one per group of leaves: unscale and both clips folded into one
   divisor (``grad_scale``), the skip on overflow (``found_inf``), the update of master
   and moments, read once and written once;
4. one copy of the masters into the low-precision params.

``MultiSteps(inner, k).gradient_transformation()`` as the inner transform takes
``fused_multi_step`` (``precision/_fused_multi.py``).

The PyTorch idiom for the same step (float32 main grads, ``GradScaler.unscale_``,
``clip_grad_norm_``, fused AdamW, copy back) makes six passes.

How it differs from the pure path, and why that is the same step:

- The norm is measured on the scaled gradients and multiplied by ``1 / loss_scale``. For
  a power-of-two scale this is bitwise the pure path's norm of the unscaled gradients,
  unless a square of a scaled gradient leaves float32's range (a scaled gradient above
  $2^{64}$ or below $2^{-75}$ in magnitude; float16 gradients never do). A non-finite
  gradient makes the norm non-finite, which is the overflow test: the pure path's
  non-finite count and its norm-overflow rule give the same decision.
- The zero count (``count_zeros=True``) reads the gradients before unscaling: an element
  that unscaling would underflow to zero (a scaled gradient below $2^{-149}$ times the
  scale, in the subnormals) is counted by the pure path only.
- Unscaling and clipping are one division by ``loss_scale / clip_factor`` instead of two
  multiplications: the gradients agree to rounding (float64 leaves are divided in
  float64, the kernels take a float32 divisor).
- On overflow the kernel leaves masters and moments untouched and the params are
  copied from the unchanged masters, which gives back the params bitwise when they are
  the rounded masters (as every step leaves them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from functopt._collective.agreement import Agreement, reduce_stats
from functopt._collective.dtensor import _rewrap_like, local_tensor
from functopt._collective.stats import (
    SUMSQ,
    ZEROS,
    counted_leaves,
    pack_sums,
    square_groups,
    sum_squares,
    unpack_sums,
    zero_count,
)
from functopt.fast import _compiled, _planned, _planner, _programs
from functopt.fast._layout import end_to_end
from functopt.precision import _host
from functopt.precision.loss_scale import (
    LossScale,
    LossScaleState,
    _inverse,
    has_host_rule,
    host_adjust,
)
from functopt.precision.stats import (
    GradStats,
    NormClip,
    _clip_factor,
    _host_clip_factor,
    unpack_grad_stats,
)
from functopt.tree import _core

# The packed statistics: grad_stats' three entries, then one sum of squares per clip of
# the inner chain (one all-reduce for all of them).
_CLIPS = ZEROS + 1


# (sum of squares, zero count, one sum of squares per clip), each a 0-d float64 tensor or
# None where no leaf is counted (or zeros are not)
_Sums = tuple[torch.Tensor | None, torch.Tensor | None, list[torch.Tensor | None]]


def _local_sums(grads: list[Any], wide: list[Any], name: Callable[[int], str],
                inv_scale: torch.Tensor | Callable[[], torch.Tensor], device: torch.device,
                count_zeros: bool, clips: list[list[int]], counted: Sequence[bool] | None,
                host_inv: float | None = None) -> _Sums:
    """The sum of squares, zero count and clip sums of the unscaled gradients this rank
    counts, from one ``foreach`` norm per (device, dtype) group (`_packed` lays them out).

    ``wide`` holds the gradients in the precision of the values they update (local
    shards); each is reduced in float32, or float64 when it is float64, as the pure path
    reduces its unscaled gradients, times ``inv_scale`` (the 0-d tensor, or a function that
    makes it when it is needed). ``grads`` (the gradients as given) decide which leaves
    this rank counts, unless ``counted`` (one bool per leaf) says it; ``clips`` lists the
    leaves each clip of the inner chain measures. ``host_inv``: ``inv_scale``'s value,
    whose products with the norms of plain CPU tensors are then taken on the host."""
    if counted is None:
        counted = counted_leaves(grads, name)
    counted = [c and w is not None for c, w in zip(counted, wide, strict=True)]
    if host_inv is not None and _host.on_host(
            *(w for w, c in zip(wide, counted, strict=True) if c)):
        groups = square_groups(wide, counted, host=host_inv)
    else:
        groups = square_groups(wide, counted, inv_scale() if callable(inv_scale) else inv_scale)
    total = sum_squares(groups, None, device)
    sums = [sum_squares(groups, leaves, device) for leaves in clips]
    # (on the gradients as given, a cast keeps zeros: half the bytes of a float32 cast)
    zeros = zero_count([local_tensor(g) for g, c in zip(grads, counted, strict=True) if c],
                       device) if count_zeros else None
    return total, zeros, sums


def _packed(sums: _Sums, device: torch.device) -> torch.Tensor:
    total, zeros, clip_sums = sums
    packed = torch.zeros(_CLIPS + len(clip_sums), dtype=torch.float64, device=device)
    if total is not None:
        packed[SUMSQ] = total
    for j, s in enumerate(clip_sums):
        if s is not None:
            packed[_CLIPS + j] = s
    if zeros is not None:
        packed[ZEROS] = zeros
    # packed[NONFINITE] stays 0: a non-finite gradient makes the sum of squares
    # non-finite, which unpack_grad_stats reads as an overflow (as a norm overflow).
    return packed


def _widened(grads: list[Any], views: list[Any], workspace: list[Any] | None,
             given: set[int] | None = None) -> list[Any]:
    """Each gradient's local shard in its view's dtype: itself, or a cast; as given at the
    leaves of ``given`` (a compiled call casts them).

    The casts are grouped by (device, dtype to dtype) into one ``foreach`` copy each,
    which runs several times faster on the CPU than a ``.to()`` per leaf. With a
    ``workspace`` (a list kept by the caller between steps), each cast is written into the
    buffer of the previous step when it fits: fresh memory costs page faults on first touch
    (on the CPU, several times the copy itself).
    """
    out: list[Any] = [None] * len(grads)
    if workspace is not None and len(workspace) != len(grads):
        workspace[:] = [None] * len(grads)
    groups: dict[tuple[torch.device, torch.dtype, torch.dtype],
                 tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for i, (g, v) in enumerate(zip(grads, views, strict=True)):
        if g is None or v is None:
            continue
        local = local_tensor(g)
        if local.dtype == v.dtype or (given and i in given):
            out[i] = local
            continue
        wide = None if workspace is None else workspace[i]
        if not (isinstance(wide, torch.Tensor) and wide.shape == local.shape
                and wide.dtype == v.dtype and wide.device == local.device):
            wide = torch.empty(local.shape, dtype=v.dtype, device=local.device)
            if workspace is not None:
                workspace[i] = wide
        dst, src = groups.setdefault((local.device, local.dtype, v.dtype), ([], []))
        dst.append(wide)
        src.append(local)
        out[i] = wide
    for dst, src in groups.values():
        torch._foreach_copy_(dst, src)
    return out


def _recalled_casts(casts: dict[str, Any], grads: list[Any], views: list[Any],
                   workspace: list[Any]) -> list[Any]:
    """`_widened` of a recalled step's plain gradients (precision/_seen.py: their shapes and
    devices are the params' seen, their dtypes one of two) into ``workspace``, with the
    grouping of the last step that cast gradients of these dtypes into these very buffers;
    made again (by `_widened`) otherwise."""
    dtypes = [None if g is None else g.dtype for g in grads]
    plan = casts.get("widen")
    if plan is not None and plan[0] == dtypes and len(workspace) == len(grads) and all(
            workspace[i] is b and b.shape == shape and b.dtype == dtype
            for i, b, shape, dtype in plan[2]):
        out = list(grads)
        for idx, dst in plan[1]:
            torch._foreach_copy_(dst, [grads[i] for i in idx])
            for i, b in zip(idx, dst, strict=True):
                out[i] = b
        for i in plan[3]:
            out[i] = None
        return out
    out = _widened(grads, views, workspace)
    groups: dict[tuple[torch.device, torch.dtype, torch.dtype], list[int]] = {}
    for i, (g, w) in enumerate(zip(grads, out, strict=True)):
        if g is not None and w is not None and w is not g:
            groups.setdefault((g.device, g.dtype, w.dtype), []).append(i)
    casts["widen"] = (dtypes, [(idx, [out[i] for i in idx]) for idx in groups.values()],
                      [(i, out[i], out[i].shape, out[i].dtype)
                       for idx in groups.values() for i in idx],
                      [i for i, w in enumerate(out) if w is None])
    return out


def _recalled_writes(casts: dict[str, Any], params: list[Any], stores: list[Any],
                     grads: list[Any], values: list[Any], low: list[Any] | None,
                     ) -> tuple[list[Any], list[Any]]:
    """`_write_params` of a donated recalled step (its params and stores those seen, plain
    tensors), with the grouping of the last step whose gradients and written params were
    None at the same leaves; made again otherwise."""
    pattern = ([g is None for g in grads],
               None if low is None else [w is None for w in low])
    plan = casts.get("write")
    if plan is None or plan[0] != pattern:
        copies: dict[torch.dtype, list[int]] = {}
        own, written = [], []
        for i, (p, s, g) in enumerate(zip(params, stores, grads, strict=True)):
            if p is None or g is None:
                continue
            if s is None:
                own.append(i)
            elif low is not None and low[i] is not None:
                written.append(i)
            else:
                copies.setdefault(p.dtype, []).append(i)
        plan = casts["write"] = (pattern, own, written,
                                 [(idx, [params[i] for i in idx]) for idx in copies.values()])
    _, own, written, copies_of = plan
    new_params = list(params)
    new_stores = list(stores)
    for i in own:
        new_params[i] = values[i]
    for i in written:
        new_stores[i] = values[i]
        new_params[i] = low[i]  # type: ignore[index]  # (written: low is not None)
    for idx, dst in copies_of:
        src = [values[i] for i in idx]
        for i, v in zip(idx, src, strict=True):
            new_stores[i] = v
        torch._foreach_copy_(dst, src)  # round to nearest, in place (params are donated)
    return new_params, new_stores


def _flat_casts(groups: list[Any], grads: list[Any], views: list[Any],
                workspace: list[Any], given: set[int]) -> None:
    """Lay the gradient casts of each compiled group (whose gradients all need one) in
    ``workspace`` as views of one buffer, in the group's order and its values' layout, so
    that `_widened` casts into them and the group's call reads them without gathering.
    Buffers laid out so at an earlier step are kept; the groups of ``given`` (whose calls
    read their gradients as given) have none."""
    if len(workspace) != len(grads):
        workspace[:] = [None] * len(grads)
    for group in groups:
        if group.plan.kernel != "compiled" or any(i in given for i in group.leaves):
            continue
        idx = [i for i in group.leaves if local_tensor(views[i]).numel()]
        values = [local_tensor(views[i]) for i in idx]
        if not idx or any(local_tensor(grads[i]).dtype == v.dtype
                          for i, v in zip(idx, values, strict=True)):
            continue
        have = [workspace[i] for i in idx]
        if all(isinstance(w, torch.Tensor) and w.shape == v.shape and w.dtype == v.dtype
               and w.stride() == v.stride() for w, v in zip(have, values, strict=True)) and (
                end_to_end(have) is not None):
            continue
        flat = torch.empty(sum(v.numel() for v in values), dtype=values[0].dtype,
                           device=values[0].device)
        for i, view in zip(idx, _compiled._scatter(flat, values), strict=True):
            workspace[i] = view


def lay_out_params(planner: _planner.Planner, treespec: Any, params: list[Any],
                   master_weights: Any, inner: Any, name: Callable[[int], str]) -> None:
    """A compiled mixed step's ``lay_out``: the params of each compiled group (all of one
    dtype; a group mixing float32 params with bfloat16 ones is left as it is, as its
    gradients are then cast anyway) and their gradients moved into one buffer per group."""
    stores = [None if p is None else master_weights.init(p) for p in params]
    views = [None if p is None else master_weights.view(p, s)
             for p, s in zip(params, stores, strict=True)]
    _planner.check_donation(params, name)  # one buffer cannot hold params sharing memory
    inner_leaves, inner_spec = _core.flatten(inner.init(_core.unflatten(treespec, views)))
    groups = planner.compiled_groups(treespec, views, inner_leaves, inner_spec,
                                     compiled_first=True)
    if groups is not None:
        with torch.no_grad():
            _compiled.lay_out_params(
                params, [g for g in groups if len({params[i].dtype for i in g.leaves}) == 1],
                name)


def flat_init(planner: _planner.Planner, treespec: Any, stores: list[Any], views: list[Any],
              inner_state: Any) -> tuple[list[Any], Any]:
    """The masters and inner state of a new mixed step laid out for the compiled tier:
    each compiled group's masters and per-leaf state entries as views of one buffer (equal
    values). Returns ``(stores, inner_state)``."""
    inner_leaves, inner_spec = _core.flatten(inner_state)
    groups = planner.compiled_groups(treespec, views, inner_leaves, inner_spec,
                                     compiled_first=True)
    if groups is None:
        return stores, inner_state
    laid_views, laid = _compiled.flat_layout(
        views, [s is not None and s is v for s, v in zip(stores, views, strict=True)],
        inner_leaves, groups)
    new_stores = [laid_views[i] if s is not None and s is views[i] else s
                  for i, s in enumerate(stores)]
    return new_stores, _core.unflatten(inner_spec, laid)


def _lowered(planner: _planner.Planner, treespec: Any, params: list[Any], stores: list[Any],
             views: list[Any], grads: list[Any], inner_state: Any, name: Callable[[int], str],
             donate: bool, compiled: bool,
             ) -> tuple[_programs.Structure, list[Any], _planned.Lowered]:
    """The planner's lowering of the inner transform over the master-precision values (its
    reason in ``Lowered.reason`` when it has none); returns ``(structure, inner state
    leaves, lowered)``. With donation, params and stores are checked for shared memory."""
    proxies = [None if g is None else v for g, v in zip(grads, views, strict=True)]
    inner_leaves, inner_spec = _core.flatten(inner_state)
    structure = planner.structure(_core.unflatten(treespec, views), treespec, views,
                                  inner_leaves, inner_spec)
    mastered = [i for i, s in enumerate(stores) if s is not None]
    donated = [*params, *(views[i] for i in mastered)] if donate else None
    if donated is not None:
        # at every call: the planner checks on a miss of its memo only, whose key holds
        # the masters but not the low-precision params (one tied to another since is
        # written twice); a step that recalls its inputs (_seen.py) saw these unchanged
        _planner.check_donation(params, name)
        labels = [f"param {name(i)!r}" for i in range(len(params))]
        labels += [f"state.master {name(i)!r}" for i in mastered]
        pair = _planner.overlap(donated, lambda k: labels[k], "tensor")
        if pair is not None:
            raise ValueError(
                f"{labels[pair[0]]} and {labels[pair[1]]} share memory, so a donated step "
                f"would write one over the other. Fix: give each master its own tensor "
                f"(the state that init makes, or functopt.tree.map(torch.clone, state)), or "
                f"step without donate.")
    lowered = planner.lower(structure, inner_spec, views, proxies, inner_leaves, name,
                            donated=donated, compiled=compiled, compiled_first=compiled)
    return structure, inner_leaves, lowered


def fused_mixed_step(
    planner: _planner.Planner, params: list[Any], stores: list[Any], views: list[Any],
    grads: list[Any], inner_state: Any, loss_scale: LossScaleState, *, treespec: Any,
    scale_rule: LossScale, scaled: bool, max_grad_norm: float | torch.Tensor | NormClip | None,
    group: dist.ProcessGroup | None, name: Callable[[int], str], count_zeros: bool,
    donate: bool, workspace: list[Any] | None = None, counted: Sequence[bool] | None = None,
    compiled: bool = False, scratch: dict[Any, Any] | None = None,
    lowering: tuple[_programs.Structure, list[Any], _planned.Lowered] | None = None,
    metrics: Any = None, casts: dict[str, Any] | None = None, agreed: Agreement | None = None,
) -> tuple[list[Any], list[Any], Any, GradStats, LossScaleState] | str:
    """The mixed-precision step on the planner's kernels (see the module docstring), or the
    reason the planner gives why it cannot lower these leaves (the caller then takes the
    pure path).

    ``workspace``: a list the caller keeps between steps, where the gradient casts are
    written (see `_widened`); ``None`` allocates them at every step. ``counted``: per leaf,
    whether this rank counts it in the statistics (``functopt._collective.counting``).
    ``compiled``: inner rules without a kernel take the planner's compiled tier, with
    ``scratch`` (kept by a donating caller) for its gathered copies.

    ``lowering``: `_lowered` for these inputs, made already (the inner state's
    leaves with it). ``metrics``: the state's ``StepMetrics``, whose tensors the host
    path keeps where their values do not move (with donation). ``casts``: a dict kept
    with these inputs' record (precision/_seen.py), where the gradient casts and the
    param writes keep their grouping between steps (`_Casts`). ``agreed``: where the
    overflow verdict is agreed (``functopt/_collective/agreement.py``).

    Returns ``(new params, new stores, new inner state, statistics, new loss scale)``.
    """
    structure, inner_leaves, lowered = lowering or _lowered(
        planner, treespec, params, stores, views, grads, inner_state, name, donate, compiled)
    if lowered.reason is not None:
        return lowered.reason
    # the gradients in the precision of the values they update (a cast is a new tensor);
    # a compiled group's call reads them as given and casts them itself where it can,
    # else its casts go into one buffer, which its call then reads in place
    given = _compiled.given_reads(lowered, grads, views) if compiled else None
    if workspace is not None and given is not None:
        _flat_casts(lowered.groups, grads, views, workspace, given)
    wide = _widened(grads, views, workspace, given) if casts is None or workspace is None else (
        _recalled_casts(casts, grads, views, workspace))
    device = loss_scale.scale.device
    if _host_bookkeeping(loss_scale, scale_rule, max_grad_norm):
        return _host_kernel_step(planner, lowered, params, stores, views, grads, wide,
                                 inner_leaves, loss_scale, scale_rule=scale_rule,
                                 scaled=scaled, max_grad_norm=max_grad_norm, group=group,
                                 name=name, count_zeros=count_zeros, donate=donate,
                                 counted=counted, scratch=scratch, metrics=metrics,
                                 casts=casts, agreed=agreed)
    inv_scale = _inverse(loss_scale)
    local = _packed(_local_sums(grads, wide, name, inv_scale, device, count_zeros,
                                structure.clips, counted), device)
    totals = _early_totals(lowered, views, wide, inner_leaves, group, max_grad_norm,
                           lambda: inv_scale.to(torch.float64) if scaled else None)
    packed, sums, totals = _all_reduced(local, totals, len(structure.clips), group, agreed,
                                        device)
    stats = unpack_grad_stats(packed[:_CLIPS])
    new_loss_scale = scale_rule.adjust(loss_scale, stats.found_inf)

    # one multiplier for unscale and clip, in float64 (the kernel rounds its divisor)
    multiplier = None
    if scaled or max_grad_norm is not None:
        multiplier = inv_scale.to(torch.float64)
        if max_grad_norm is not None:
            outer = _clip_factor(packed, max_grad_norm).to(device)
            multiplier = multiplier * outer
            sums = [s * outer * outer for s in sums]  # the inner clips see clipped grads

    # an apply_if_finite in the inner chain sees finite gradients whenever the step is not
    # skipped (a non-finite gradient makes the norm non-finite, which skips the step)
    finite = [~stats.found_inf] * len(structure.guards)
    result = _kernel_step(planner, lowered, params, stores, views, grads,
                          _kernel_casts(grads, wide, multiplier, lowered), inner_leaves,
                          donate, scratch, multiplier=multiplier, found_inf=stats.found_inf,
                          sums=sums, finite=finite, totals=totals)
    if isinstance(result, str):
        return result
    return *result, stats, new_loss_scale


def _early_totals(lowered: _planned.Lowered, views: list[Any], wide: list[Any],
                  inner_leaves: list[Any], group: dist.ProcessGroup | None,
                  max_grad_norm: float | torch.Tensor | NormClip | None,
                  multiplier: Callable[[], torch.Tensor | None]) -> dict[int, Any] | None:
    """This process's tree sums of the inner chain's rules that have them (Prodigy's), to
    be summed over the ranks in the statistics' one all-reduce, or None where they are
    taken after it (the planner's `run`): on one process (no collective to share), or
    where their sums pass needs a clip factor that only the statistics give (the step's
    ``max_grad_norm``, an inner clip). ``multiplier``: the unscale the kernels will
    apply, known before the statistics then (`fused_mixed_step`'s, without a clip)."""
    structure = lowered.structure
    if group is None or not structure.tree_wide or structure.clips or (
            max_grad_norm is not None):
        return None
    scale = multiplier()
    # (the sums pass reads the casts the kernels will read: `_kernel_casts` copies them)
    return _planned.local_tree_sums(structure, [(g, scale) for g in lowered.groups], views,
                                    wide, inner_leaves)


def _kernel_casts(grads: list[Any], wide: list[Any], multiplier: torch.Tensor | None,
                  lowered: _planned.Lowered) -> list[Any]:
    """The gradients the kernels read. They unscale in place: a gradient that needed no
    cast is the caller's, never written, so it is copied when it will be scaled (a
    compiled call scales out of place: its gradients are read as they are)."""
    if multiplier is None and not lowered.structure.clips:
        return wide
    compiled = {i for group in lowered.groups if group.plan.kernel == "compiled"
                for i in group.leaves}
    return [w if w is None or w is not local_tensor(g) or i in compiled else w.clone()
            for i, (g, w) in enumerate(zip(grads, wide, strict=True))]


def _host_bookkeeping(loss_scale: LossScaleState, rule: LossScale,
                      max_grad_norm: float | torch.Tensor | NormClip | None) -> bool:
    """Whether the step's scalars (loss scale, statistics, clip factor) are computed on the
    host (precision/_host.py): they are plain CPU tensors, the rule is a built-in one, and
    the scale is not nan (whose payload only the tensors would carry through)."""
    return (has_host_rule(rule) and _host.on_host(*loss_scale) and (
        not isinstance(max_grad_norm, torch.Tensor) or _host.on_host(max_grad_norm))
        and not math.isnan(loss_scale.scale.item()))


def _host_kernel_step(
    planner: _planner.Planner, lowered: _planned.Lowered, params: list[Any],
    stores: list[Any], views: list[Any], grads: list[Any], wide: list[Any],
    inner_leaves: list[Any], loss_scale: LossScaleState, *, scale_rule: LossScale,
    scaled: bool, max_grad_norm: float | torch.Tensor | NormClip | None,
    group: dist.ProcessGroup | None, name: Callable[[int], str], count_zeros: bool,
    donate: bool, counted: Sequence[bool] | None, scratch: dict[Any, Any] | None,
    metrics: Any, casts: dict[str, Any] | None = None, agreed: Agreement | None = None,
) -> tuple[list[Any], list[Any], Any, GradStats, LossScaleState] | str:
    """The rest of `fused_mixed_step` with its scalars on the host: the same statistics
    (one read of their sums), loss scale, clip factor and multiplier, computed in Python
    with the tensors' roundings (bitwise theirs: precision/_host.py), and a finite step
    runs the kernels without a ``found_inf`` (which they would read as 0)."""
    structure = lowered.structure
    device = loss_scale.scale.device
    f32 = _host.f32
    totals = None
    # 1 / scale in float64, rounded once to float32 (`_inverse`)
    inv = f32(_host.reciprocal(loss_scale.scale.item()))
    local = _local_sums(grads, wide, name, lambda: torch.scalar_tensor(
        inv, dtype=torch.float32, device=device), device, count_zeros, structure.clips,
                        counted, host_inv=inv)
    if group is None and agreed is None:
        total, zeros, clip_sums = local
        nonfinite = 0.0  # (never counted: see _packed)
        sumsq = 0.0 if total is None else total.item()
        num_zeros = 0.0 if zeros is None else zeros.item()
        sums = [torch.zeros((), dtype=torch.float64, device=device) if x is None else x
                for x in clip_sums]
    else:
        totals = _early_totals(lowered, views, wide, inner_leaves, group, max_grad_norm,
                               lambda: torch.scalar_tensor(inv, dtype=torch.float64,
                                                           device=device) if scaled else None)
        packed, sums, totals = _all_reduced(_packed(local, device), totals,
                                            len(structure.clips), group, agreed, device)
        sumsq, nonfinite, num_zeros = packed[:_CLIPS].tolist()
    # unpack_grad_stats: the norm in float32; a non-finite one is an overflow too
    norm = f32(math.sqrt(sumsq))
    found = nonfinite > 0 or not math.isfinite(norm)
    new_loss_scale = host_adjust(scale_rule, loss_scale, found, reuse=donate)
    multiplier = None
    if scaled or max_grad_norm is not None:
        m = inv
        if max_grad_norm is not None:
            outer = _host_clip_factor(max_grad_norm, sumsq)  # _clip_factor's bits
            m = m * outer
            sums = [s * outer * outer for s in sums]  # the inner clips see clipped grads
        multiplier = torch.scalar_tensor(m, dtype=torch.float64, device=device)
    old = metrics if metrics is not None and _host.on_host(*metrics) else None
    found_inf = torch.scalar_tensor(found, dtype=torch.bool, device=device) if (
        old is None) else _host.kept(found, old.found_inf, donate)
    finite = [torch.scalar_tensor(not found, dtype=torch.bool, device=device)] * len(
        structure.guards) if structure.guards else []
    result = _kernel_step(planner, lowered, params, stores, views, grads,
                          _kernel_casts(grads, wide, multiplier, lowered), inner_leaves,
                          donate, scratch, multiplier=multiplier,
                          found_inf=found_inf if found else None, sums=sums, finite=finite,
                          keep_dtypes=not found, casts=casts, totals=totals)
    if isinstance(result, str):
        return result
    new_params, new_stores, new_inner = result
    # (the metrics read the zero count only where counted: -1 as they hold it otherwise)
    zeros = torch.scalar_tensor(int(num_zeros), dtype=torch.int64, device=device) if (
        count_zeros or old is None) else _host.kept(-1, old.num_zeros, donate)
    stats = GradStats(norm=torch.scalar_tensor(norm, dtype=torch.float32, device=device),
                      found_inf=found_inf, num_zeros=zeros)
    return new_params, new_stores, new_inner, stats, new_loss_scale


def _kernel_step(planner: _planner.Planner, lowered: _planned.Lowered, params: list[Any],
                 stores: list[Any], views: list[Any], grads: list[Any],
                 kernel_grads: list[Any], inner_leaves: list[Any], donate: bool,
                 scratch: dict[Any, Any] | None, keep_dtypes: bool = False,
                 casts: dict[str, Any] | None = None, **options: Any,
                 ) -> tuple[list[Any], list[Any], Any] | str:
    """The planner's kernels on the master-precision values and ``kernel_grads`` (which
    they may scale in place), then the params written from the new masters; ``options``
    go to ``_planned.run``. Returns ``(new params, new stores, new inner state)`` or the
    reason the run refused, before any write.

    ``keep_dtypes``: the injected hyperparameters keep the dtypes of ``inner_leaves``,
    as a run with a ``found_inf`` keeps them (its select casts a new value to the old
    one's dtype; one without takes the value as the schedule gave it). ``casts``: see
    `fused_mixed_step`."""
    result = _planned.run(lowered, views, kernel_grads, inner_leaves, donate=donate,
                          donate_grads=True, reads=planner.reads, workspace=scratch,
                          low=[p if s is not None else None
                               for p, s in zip(params, stores, strict=True)], **options)
    if isinstance(result, str):
        return result
    if keep_dtypes:
        leaves = result.leaves
        for inj in lowered.structure.injections:
            for i in inj.hyper.values():
                if leaves[i] is not inner_leaves[i] and leaves[i].dtype != inner_leaves[i].dtype:
                    leaves[i] = leaves[i].to(inner_leaves[i].dtype)
    if casts is not None and donate:
        new_params, new_stores = _recalled_writes(casts, params, stores, grads,
                                                  result.values, result.low)
    else:
        new_params, new_stores = _write_params(params, stores, grads, result.values,
                                               result.low, donate)
    return new_params, new_stores, result.state


def _write_params(params: list[Any], stores: list[Any], grads: list[Any], values: list[Any],
                  low: list[Any] | None, donate: bool) -> tuple[list[Any], list[Any]]:
    """The new params and stores from the new values (masters, or the params that are their
    own): each param with a master is its new master rounded (one ``foreach`` copy per
    group, in place, when donated), unless ``low`` holds it already written."""
    written = low or [None] * len(params)
    new_params = list(params)
    new_stores = list(stores)
    copies: dict[tuple[torch.device, torch.dtype], tuple[list[Any], list[Any]]] = {}
    for i, (p, s, g) in enumerate(zip(params, stores, grads, strict=True)):
        if p is None or g is None:
            continue
        value = values[i]
        if s is None:  # the param is its own master
            new_params[i] = value
            continue
        new_stores[i] = value
        if written[i] is not None:  # the compiled call rounded it into the param
            new_params[i] = written[i]
            continue
        if donate:
            dst, src = copies.setdefault((p.device, p.dtype), ([], []))
            dst.append(local_tensor(p))
            src.append(local_tensor(value))
        else:
            new_params[i] = _rewrap_like(p, local_tensor(value).to(p.dtype))
    for dst, src in copies.values():
        torch._foreach_copy_(dst, src)  # round to nearest, in place (params are donated)
    return new_params, new_stores


def _scaled(unscaled: list[Any], grads: list[Any], multiplier: torch.Tensor) -> list[Any]:
    """Each tensor times ``multiplier`` (a 0-d tensor, in the tensor's dtype: as the pure
    path's ``g * m.to(g.dtype)``), one ``foreach`` multiply per (device, dtype) group: in
    place on the step's own casts, out of place for a gradient that is the caller's."""
    out = list(unscaled)
    groups: dict[tuple[torch.device, torch.dtype, bool], list[int]] = {}
    for i, (u, g) in enumerate(zip(unscaled, grads, strict=True)):
        if u is not None:
            groups.setdefault((u.device, u.dtype, u is local_tensor(g)), []).append(i)
    for (device, dtype, given), idx in groups.items():
        m = multiplier.to(device=device, dtype=dtype)
        tensors = [unscaled[i] for i in idx]
        if given:
            for i, t in zip(idx, torch._foreach_mul(tensors, m), strict=True):
                out[i] = t
        else:
            torch._foreach_mul_(tensors, m)
    return out


def _all_reduced(local: torch.Tensor, totals: dict[int, Any] | None, n: int,
                 group: dist.ProcessGroup | None, agreed: Agreement | None,
                 device: torch.device,
                 ) -> tuple[torch.Tensor, list[torch.Tensor], dict[int, Any] | None]:
    """``local`` (the statistics, then ``n`` sums) with the tree sums of ``totals`` after
    them, summed over the ranks in one all-reduce (``reduce_stats``); returns ``(packed,
    its n sums, the summed totals)``."""
    if totals:
        local = torch.cat([local, torch.stack(pack_sums(totals)).to(device)])
    packed = reduce_stats(local, group, agreed)
    if totals:
        totals = unpack_sums(totals, list(packed[_CLIPS + n:].unbind()))
    return packed, list(packed[_CLIPS:_CLIPS + n].unbind()), totals
