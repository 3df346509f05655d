"""Megatron-LM's optimizer calls on ``MixedPrecisionOptimizer``.

The methods of megatron-core's ``MegatronOptimizer`` (0.16.1,
``megatron/core/optimizer/optimizer.py``) that its training loop, its pipeline schedules
and its ``ChainedOptimizer`` call: ``scale_loss`` (the schedules' ``grad_scale_func``),
``get_parameters``, ``get_main_grads_for_grad_norm``, ``get_grad_stats_parallel_group``,
and the two halves of a step, ``prepare_grads`` and ``step_with_ready_grads``. A mixin of
the facade: it reads the facade's params, gradients, loss scale and distributed
declarations, and takes steps only through the facade's own ``step()``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import optree
import torch
import torch.distributed as dist

from functopt._collective.agreement import threshold_verdict
from functopt._collective.counting import _counting, _entries
from functopt._collective.dtensor import _leaf_names, local_tensor
from functopt.precision.loss_scale import _inverse
from functopt.precision.master import MasterWeights
from functopt.precision.stats import GradStats
from functopt.precision.step import MixedPrecisionState, check_loss, scale_loss
from functopt.tree import _core

__all__ = ["MegatronSurface"]

_OWNER = "MixedPrecisionOptimizer"


class MegatronSurface:
    """Megatron-LM's ``MegatronOptimizer`` methods, over the facade's own state."""

    # the facade's (functopt/adapters/mixed_precision_optimizer.py)
    _params: list[torch.Tensor]
    _names: list[str]
    _distributed: dict[str, Any]
    _agree: tuple[Any, Any]
    _master_weights: MasterWeights
    _state: MixedPrecisionState

    if TYPE_CHECKING:
        def _grads(self) -> list[torch.Tensor | None]: ...

        def _tree(self, leaves: list[Any]) -> Any: ...

        def _stats(self, grads: list[torch.Tensor | None]) -> GradStats: ...

        def step(self, closure: Any = None) -> Any: ...

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current loss scale, in ``loss``'s dtype and shape.

        Megatron's pipeline schedules call it as ``config.grad_scale_func`` on each
        micro-batch's loss before running backward themselves, and on ``torch.ones(1)``
        for the MoE auxiliary losses' scale; set ``config.grad_scale_func =
        optimizer.scale_loss``. The product is taken in float32 (float64 for a float64
        loss) and rounded once to ``loss``'s dtype (Megatron's returns its scale's float32
        shape ``[1]``); gradients flow through it as through ``loss * scale``.
        [`backward`][functopt.MixedPrecisionOptimizer.backward] keeps the float32
        product instead, where a float16 loss times ``2**16`` would overflow.

        Raises:
            TypeError: ``loss`` is not a floating-point tensor.
        """
        check_loss(f"{_OWNER}.scale_loss", loss)
        return scale_loss(loss, self._state).to(loss.dtype)

    def get_parameters(self) -> list[torch.Tensor]:
        """The params the step updates, in group order (frozen groups left out, as
        Megatron leaves params that do not require grad out of its groups)."""
        return list(self._params)

    def _counted(self) -> tuple[dist.ProcessGroup | None, list[bool]]:
        """The group the gradient statistics are summed over and, per param (in
        ``_params`` order), whether this rank counts it, as the step decides them."""
        tree = self._tree(list(self._params))
        leaves, treespec = _core.flatten(tree)
        group, counted = _counting(
            f"{_OWNER}.get_main_grads_for_grad_norm", leaves, _leaf_names(treespec),
            self._distributed["process_group"],
            _entries(_OWNER, self._distributed["replicated"], tree, leaves, treespec))
        order = optree.tree_leaves(self._tree(list(range(len(self._params)))))
        mine = [False] * len(self._params)
        for position, index in enumerate(order):
            mine[index] = counted[position]
        return group, mine

    def get_grad_stats_parallel_group(self) -> dist.ProcessGroup:
        """The process group the gradient norm and zero count are summed over.

        The ``process_group`` given at construction, or the group inferred from DTensor
        params (FSDP2); Megatron's model-parallel group.

        Raises:
            ValueError: the statistics are summed over no group (plain tensors without
                ``process_group``: each rank's own), where Megatron's would name the
                model-parallel group.
        """
        group, _ = self._counted()
        if group is None:
            raise ValueError(
                f"{_OWNER}.get_grad_stats_parallel_group: the gradient statistics are "
                f"summed over no process group here (plain tensor params and no "
                f"process_group): each rank's norm is its own. Fix: pass process_group= "
                f"(Megatron's model-parallel group) and replicated= at construction.")
        return group

    def get_main_grads_for_grad_norm(self) -> list[torch.Tensor]:
        """The unscaled gradients this rank counts in the global norm, as new tensors.

        Megatron's filter, by functopt's declarations: params with a gradient (read from
        ``.decoupled_grad``, ``.main_grad`` or ``.grad``, as the step reads them), each
        counted once over the statistics group (a param ``replicated`` over it on one of
        its ranks only, where Megatron keeps tensor-parallel duplicates on tensor rank 0),
        DTensor gradients as their local shards. Each is divided by the loss scale in
        the step's precision (the masters' dtype or wider), so the sum of their squares
        over ``get_grad_stats_parallel_group()`` is the square of ``get_grad_norm()``.
        """
        _, counted = self._counted()
        inv_scale = _inverse(self._state.loss_scale)
        master = self._master_weights.dtype
        out = []
        with torch.no_grad():
            for p, g, mine in zip(self._params, self._grads(), counted, strict=True):
                if g is None or not mine:
                    continue
                wide = torch.promote_types(p.dtype, master)
                out.append(local_tensor(g).to(wide) * inv_scale.to(g.device, wide))
        return out

    def prepare_grads(self) -> bool:
        """The first half of Megatron's step: True when the current gradients overflowed.

        The overflow verdict of the next ``step()``, agreed as the step agrees it (over
        the statistics group and ``agree_skip``'s ranks). On overflow the skipped step is
        taken here, as Megatron's ``prepare_grads`` updates its loss scale: params,
        masters and the transform's state are left unchanged, the loss scale backs off,
        and the caller must not call ``step_with_ready_grads``. On finite gradients
        nothing changes: clip or inspect them, then call ``step_with_ready_grads()``. The
        verdict costs a statistics pass (and its all-reduce) of its own, beside the one of
        the step that follows; ``step()`` alone makes one.
        """
        stats = self._stats(self._grads())
        _, found = threshold_verdict(stats.norm, stats.found_inf, math.inf,
                                     self._distributed["process_group"], *self._agree)
        if bool(found):
            self.step()
            return True
        return False

    def step_with_ready_grads(self) -> bool:
        """The second half of Megatron's step: ``step()`` on the current gradients, True
        when it was taken (False only where they overflowed or exceed
        ``grad_norm_skip_threshold``: call ``prepare_grads()`` first)."""
        result = self.step()
        return bool(result[0] if isinstance(result, tuple) else result)
