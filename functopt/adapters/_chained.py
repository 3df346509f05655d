"""``ChainedOptimizer``: Megatron-LM's combination of optimizers, over facades.

megatron-core's ``ChainedOptimizer`` (0.16.1, ``megatron/core/optimizer/optimizer.py``)
steps several optimizers as one: Megatron builds one per kind of param (the dense params
and the expert-parallel ones, or Muon's matrices and Adam's rest), and the chain makes one
skip decision, one gradient norm and one clip for all of them. Here each optimizer is a
[`MixedPrecisionOptimizer`][functopt.MixedPrecisionOptimizer].
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from functopt.adapters.mixed_precision_optimizer import MixedPrecisionOptimizer, StepResult
from functopt.precision.loss_scale import _rule_vector
from functopt.precision.stats import NormClip

__all__ = ["ChainedOptimizer", "ProxyDict"]

_OWNER = "ChainedOptimizer"


class ProxyDict:
    """The chain's ``state``: each optimizer's ``state`` under ``(index, param)`` keys, as
    Megatron's ``ProxyDict``.

    Examples:
        >>> import torch, functopt
        >>> w, b = torch.zeros(2), torch.ones(1)
        >>> state = functopt.ProxyDict([{w: {"mu": 1}}, {b: {"mu": 2}}])
        >>> state[(1, b)], len(state), [index for index, _ in state]
        ({'mu': 2}, 2, [0, 1])
    """

    def __init__(self, inner: list[Any]) -> None:
        self._inner = inner

    def __getitem__(self, key: tuple[int, Any]) -> Any:
        index, param = key
        return self._inner[index][param]

    def __setitem__(self, key: tuple[int, Any], value: Any) -> None:
        index, param = key
        self._inner[index][param] = value

    def __len__(self) -> int:
        return sum(len(d) for d in self._inner)

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        for index, inner in enumerate(self._inner):
            for param in inner:
                yield index, param

    def items(self) -> Iterator[tuple[tuple[int, Any], Any]]:
        """``((index, param), entry)`` over every optimizer's state."""
        for index, inner in enumerate(self._inner):
            for param, entry in inner.items():
                yield (index, param), entry


class ChainedOptimizer:
    r"""Several [`MixedPrecisionOptimizer`][functopt.MixedPrecisionOptimizer]\ s stepped as
    one, as Megatron-LM's ``ChainedOptimizer`` steps its optimizers.

    ``step()`` makes one decision for all of them: the overflow verdicts of every
    optimizer's gradients (each agreed over its own ranks), and when any overflowed every
    optimizer skips (params, masters and state unchanged, each loss scale backing off);
    otherwise the norm is the global norm of all their gradients,
    $\sqrt{\sum_i n_i^2}$ (each $n_i$ summed over its optimizer's statistics group, as
    Megatron combines optimizers whose groups differ), the gradients are clipped by it
    (the clip the optimizers were given with ``clip_grad_norm(model, max_norm)``, which
    must be the same for all, or None), and each optimizer steps on them. It returns
    Megatron's ``(ok, grad_norm, num_zeros)`` (``num_zeros`` summed where the optimizers
    count zeros, else None). The optimizers must share their loss-scale rule and current
    scale, so their scales move together: one loss scale.

    Each optimizer reads its gradients twice (the statistics for the decision, then its
    step's own) and the clip multiplies them once in place, in their dtype (the float32
    ``.main_grad`` where a param has one), as Megatron's does: about
    three passes and two all-reduces per optimizer with a process group, where one
    ``MixedPrecisionOptimizer`` over all the params (its groups combined by
    ``partition``) makes one pass and one all-reduce.

    ``param_groups``, ``get_parameters()`` and ``get_main_grads_for_grad_norm()`` are the
    optimizers' in order; ``state`` is a [`ProxyDict`][functopt.ProxyDict];
    ``state_dict()`` is the list of their state dicts (the one dict for a single
    optimizer), as Megatron's.

    Raises:
        TypeError: an optimizer that is not a ``MixedPrecisionOptimizer``.
        ValueError: no optimizers, a param in two of them, loss scales that differ, clips
            that differ, or a ``grad_norm_skip_threshold`` (one norm decides for all).

    Examples:
        >>> import torch, functopt
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        >>> dense = functopt.MixedPrecisionOptimizer(net[0].named_parameters(),
        ...                                          functopt.adamw(1e-2))
        >>> head = functopt.MixedPrecisionOptimizer(net[1].named_parameters(),
        ...                                         functopt.sgd(1e-2))
        >>> chained = functopt.ChainedOptimizer([dense, head])
        >>> chained.backward(net(torch.ones(3, 2)).pow(2).mean())
        >>> ok, norm, zeros = chained.step()
        >>> ok, zeros
        (True, None)
    """

    def __init__(self, chained_optimizers: Sequence[MixedPrecisionOptimizer]) -> None:
        optimizers = list(chained_optimizers)
        if not optimizers:
            raise ValueError(f"{_OWNER}: no optimizers to chain. Fix: pass a list of "
                             f"MixedPrecisionOptimizer, one per kind of param.")
        for i, opt in enumerate(optimizers):
            if not isinstance(opt, MixedPrecisionOptimizer):
                raise TypeError(
                    f"{_OWNER}: optimizer {i} is a {type(opt).__name__}; the chain steps "
                    f"functopt.MixedPrecisionOptimizer objects. Fix: wrap it, "
                    f"MixedPrecisionOptimizer(torch_optimizer).")
        seen: dict[int, int] = {}
        for i, opt in enumerate(optimizers):
            for p in opt.get_parameters():
                if id(p) in seen:
                    raise ValueError(
                        f"{_OWNER}: optimizers {seen[id(p)]} and {i} both update a param "
                        f"of shape {tuple(p.shape)}. Fix: give each param to one optimizer.")
                seen[id(p)] = i
        first = optimizers[0]
        for i, opt in enumerate(optimizers[1:], start=1):
            same_rule = torch.equal(_rule_vector(opt._loss_scale_rule).nan_to_num(-1.0),
                                    _rule_vector(first._loss_scale_rule).nan_to_num(-1.0))
            if not same_rule or opt.loss_scale != first.loss_scale:
                raise ValueError(
                    f"{_OWNER}: optimizer {i}'s loss scale ({opt.loss_scale}, its rule) "
                    f"differs from optimizer 0's ({first.loss_scale}); the chain has one loss "
                    f"scale. Fix: build every optimizer with the same loss_scale= rule.")
            if opt._max_grad_norm != first._max_grad_norm:
                raise ValueError(
                    f"{_OWNER}: optimizer {i} clips at {opt._max_grad_norm!r}, optimizer 0 at "
                    f"{first._max_grad_norm!r}; the chain clips all gradients by their one "
                    f"norm. Fix: call clip_grad_norm(model, max_norm) with the same bound on "
                    f"each.")
        for i, opt in enumerate(optimizers):
            if math.isfinite(opt.grad_norm_skip_threshold):
                raise ValueError(
                    f"{_OWNER}: optimizer {i} has grad_norm_skip_threshold="
                    f"{opt.grad_norm_skip_threshold}; in a chain one norm decides for all "
                    f"optimizers and a threshold of one would decide alone. Fix: leave it inf.")
        self.chained_optimizers = optimizers

    # -- what Megatron's callers read ---------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every optimizer's groups, in order (the dicts themselves: a scheduler's writes
        reach the optimizers)."""
        return [g for opt in self.chained_optimizers for g in opt.param_groups]

    @property
    def state(self) -> ProxyDict:
        """Each optimizer's ``state`` under ``(index, param)`` keys."""
        return ProxyDict([opt.state for opt in self.chained_optimizers])

    @property
    def loss_scale(self) -> float:
        """The one loss scale, a Python float (a host sync)."""
        return self.chained_optimizers[0].loss_scale

    def get_loss_scale(self) -> torch.Tensor:
        """The one loss scale, a 0-d float32 tensor."""
        return self.chained_optimizers[0].get_loss_scale()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale, in its dtype (the schedules' ``grad_scale_func``)."""
        return self.chained_optimizers[0].scale_loss(loss)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """``(loss * loss_scale).backward()``, the product in float32."""
        self.chained_optimizers[0].backward(loss, retain_graph=retain_graph)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.chained_optimizers:
            opt.zero_grad(set_to_none)

    def get_parameters(self) -> list[torch.Tensor]:
        return [p for opt in self.chained_optimizers for p in opt.get_parameters()]

    def get_main_grads_for_grad_norm(self) -> list[torch.Tensor]:
        return [g for opt in self.chained_optimizers for g in opt.get_main_grads_for_grad_norm()]

    def get_grad_stats_parallel_group(self) -> dist.ProcessGroup:
        """The optimizers' statistics group, where they share one.

        Raises:
            ValueError: their groups differ (or none has one).
        """
        groups = [opt.get_grad_stats_parallel_group() for opt in self.chained_optimizers]
        if any(g != groups[0] for g in groups):
            raise ValueError(
                f"{_OWNER}.get_grad_stats_parallel_group: the optimizers reduce their "
                f"statistics over different groups; there is no one group. Fix: ask each "
                f"optimizer (chained_optimizers[i].get_grad_stats_parallel_group()).")
        return groups[0]

    def get_grad_norm(self) -> torch.Tensor:
        """The global norm of all the optimizers' current unscaled gradients (0-d)."""
        norms = torch.stack([opt.get_grad_norm().double()
                             for opt in self.chained_optimizers])
        total: torch.Tensor = torch.linalg.vector_norm(norms)
        return total.float()

    def count_zeros(self) -> torch.Tensor:
        """The zero gradient elements of the last step, summed (-1 where none counts)."""
        counts = torch.stack([opt.count_zeros() for opt in self.chained_optimizers])
        counted = counts[counts >= 0]
        return counted.sum() if counted.numel() else counts[0]

    def reload_model_params(self, state_dict: Any = None) -> None:
        """Each optimizer's ``reload_model_params``; ``state_dict`` (one model's) is read by
        each for its own params."""
        for opt in self.chained_optimizers:
            opt.reload_model_params(state_dict)

    # -- the step -----------------------------------------------------------------------

    def _verdicts(self) -> tuple[list[Any], bool]:
        found = False
        stats = []
        for opt in self.chained_optimizers:
            s, f = opt._verdict()
            stats.append(s)
            found = found or bool(f)
        return stats, found

    def prepare_grads(self) -> bool:
        """True when any optimizer's gradients overflowed; every optimizer then skips the
        step here (each loss scale backs off) and ``step_with_ready_grads`` must not
        follow. False changes nothing."""
        stats, found = self._verdicts()
        if found:
            for opt, s in zip(self.chained_optimizers, stats, strict=True):
                opt._skip_for_norm(s, overflow=True)
        return found

    def step_with_ready_grads(self) -> bool:
        """Each optimizer's step on its current gradients, without its own clip (the chain
        clips by the norm of all; ``step()`` does both). True when every one was taken."""
        ok = True
        for opt in self.chained_optimizers:
            result = opt._step(None, clip=False)
            ok = bool(result[0] if isinstance(result, tuple) else result) and ok
        return ok

    def step(self, closure: Callable[[], Any] | None = None) -> StepResult:
        """One step of every optimizer, with one skip decision, norm and clip (see the
        class); Megatron's ``(ok, grad_norm, num_zeros)``, ``(False, None, None)`` when
        the step was skipped."""
        if closure is not None:
            with torch.enable_grad():
                closure()
        stats, found = self._verdicts()
        if found:
            for opt, s in zip(self.chained_optimizers, stats, strict=True):
                opt._skip_for_norm(s, overflow=True)
            return False, None, None
        norm = float(torch.linalg.vector_norm(torch.stack([s.norm.double() for s in stats])))
        clip = self.chained_optimizers[0]._max_grad_norm
        if clip is not None:
            bound, eps = (clip.max_norm, clip.eps) if isinstance(clip, NormClip) else (clip, 0.0)
            factor = 1.0 / max(1.0, (norm + eps) / bound)
            if factor < 1.0:
                with torch.no_grad():
                    for opt in self.chained_optimizers:
                        grads = [g for g in opt._grads() if g is not None]
                        if grads:
                            torch._foreach_mul_(grads, factor)
        ok = self.step_with_ready_grads()
        counts = [opt for opt in self.chained_optimizers if opt._count_zeros]
        zeros = sum(int(opt.count_zeros()) for opt in counts) if counts else None
        return ok, norm, zeros

    # -- checkpoints --------------------------------------------------------------------

    def state_dict(self) -> Any:
        """The optimizers' state dicts in a list (one optimizer: its dict), as Megatron's."""
        dicts = [opt.state_dict() for opt in self.chained_optimizers]
        return dicts[0] if len(dicts) == 1 else dicts

    def sharded_state_dict(self, model_sharded_state_dict: Any, is_loading: bool = False,
                           metadata: Mapping[str, Any] | None = None) -> Any:
        """Each optimizer's ``sharded_state_dict``, as megatron-core's chain combines them:
        one optimizer's alone; several in a dict by position, each one's keys prefixed
        ``chained_<i>.`` unless ``metadata["chained_optim_avoid_prefix"]`` is true."""
        dicts = [opt.sharded_state_dict(model_sharded_state_dict, is_loading, metadata)
                 for opt in self.chained_optimizers]
        if len(dicts) == 1:
            return dicts[0]
        if not (metadata or {}).get("chained_optim_avoid_prefix", False):
            from functopt.adapters._megatron_sharded import add_prefix

            for i, d in enumerate(dicts):
                add_prefix(d, f"chained_{i}.")
        return dict(enumerate(dicts))

    def load_state_dict(self, state_dict: Any) -> None:
        """Load what ``state_dict()`` returned, or what ``dist_checkpointing.load`` gave
        for ``sharded_state_dict()`` (several optimizers' dicts keyed by position).

        Raises:
            ValueError: another number of state dicts than optimizers.
        """
        dicts = [state_dict] if len(self.chained_optimizers) == 1 else state_dict
        if isinstance(dicts, Mapping) and set(dicts) == set(range(len(dicts))):
            dicts = [dicts[i] for i in range(len(dicts))]
        if not isinstance(dicts, (list, tuple)) or len(dicts) != len(self.chained_optimizers):
            raise ValueError(
                f"{_OWNER}.load_state_dict: expected a list of "
                f"{len(self.chained_optimizers)} state dicts (one per optimizer, as "
                f"state_dict() returns), got {type(state_dict).__name__}"
                f"{f' of {len(dicts)}' if isinstance(dicts, (list, tuple)) else ''}. Fix: "
                f"load it into a chain of the optimizers that saved it.")
        for opt, d in zip(self.chained_optimizers, dicts, strict=True):
            opt.load_state_dict(d)

    def offload_to_cpu(self) -> None:
        for opt in self.chained_optimizers:
            opt.offload_to_cpu()

    def restore_from_cpu(self, device_id: torch.device | str | int | None = None) -> None:
        for opt in self.chained_optimizers:
            opt.restore_from_cpu(device_id)
