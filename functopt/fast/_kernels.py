"""The planner's PyTorch kernels: a program matched to ``torch._fused_adamw_``,
``torch._fused_adam_`` or ``torch._fused_sgd_`` (or to the compiled or per-leaf tier), the
layouts the kernels read, their arguments at a step and one kernel call per `Group`."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from functopt._collective.dtensor import _rewrap_like, local_tensor
from functopt._validate import _is_number
from functopt.fast import _compiled, _perleaf, _staged
from functopt.fast._layout import dense as _dense
from functopt.fast._programs import (
    _LR_KINDS,
    _Clip,
    _Const,
    _Env,
    _Guard,
    _Negated,
    _Op,
)
from functopt.tree import _ops

__all__ = ["Group", "match"]

# The dtypes PyTorch's fused optimizer kernels accept (params, grads and moments alike).
_KERNEL_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
# torch._fused_sgd_ on the CPU skips the update of every full SIMD block of float16 and
# bfloat16 params and writes wrong momentum buffers (pytorch/pytorch#191763, fixed after
# 2.13 by #192545), so SGD takes its kernel on the CPU for these dtypes only.
_SGD_CPU_DTYPES = (torch.float64, torch.float32)


@dataclass(frozen=True)
class _KernelPlan:
    """The kernel one leaf's program lowers to, with the bindings of its arguments."""

    kernel: str  # "adamw" (decoupled decay), "adam" (L2 decay), "sgd", "zero", "compiled",
    # "perleaf" (the per-leaf tier, functopt/fast/_perleaf.py)
    clip: _Clip | None
    adam: _Op | None = None
    decay: _Op | None = None
    trace: _Op | None = None
    lr: Any = None  # binding of the (positive) learning rate
    guard: _Guard | None = None  # a leading apply_if_finite: its skip joins found_inf
    maximize: bool = False  # a leading scale(-1): the kernels' maximize flag
    ops: tuple[_Op, ...] = ()  # "compiled": the rules, in order, after the clip

    def at(self, **rules: Any) -> _KernelPlan:
        """This plan with other rules in some fields (one leaf's, which hold its per-leaf
        state entries): a copy of its fields, as `_Op.at` makes."""
        plan = object.__new__(_KernelPlan)
        plan.__dict__.update(self.__dict__, **rules)
        return plan

    def key(self) -> tuple[Any, ...]:
        if self.kernel in ("compiled", "perleaf"):
            return (self.kernel, None if self.guard is None else self.guard.index,
                    None if self.clip is None else self.clip.index,
                    tuple(op.node for op in self.ops))
        return (self.kernel, self.maximize, None if self.guard is None else self.guard.index,
                None if self.clip is None else self.clip.index,
                None if self.adam is None else self.adam.node,
                None if self.decay is None else self.decay.node,
                None if self.trace is None else self.trace.node, id(self.lr))


def _learning_rate(op: _Op) -> Any | None:
    """The binding of the descent step size of an lr op, or None (an ascent, say)."""
    if op.kernel == "learning_rate":
        flip = op.args["flip_sign"].value
        return op.args["learning_rate"] if flip else None
    if op.kernel in ("scale", "schedule"):
        step = op.args["step_size"]
        if isinstance(step, _Const) and isinstance(step.value, (int, float)):
            return _Const(-step.value) if step.value <= 0 else None
        return _Negated(step)
    return None


def match(program: list[Any], compiled: bool = False, perleaf: bool = False,
          compiled_first: bool = False) -> _KernelPlan | str:
    """The kernel for one leaf's program, or the reason there is none. ``compiled``: a
    program no PyTorch kernel covers takes the compiled tier when it can;
    ``compiled_first`` as well, every program the compiled tier takes does (the mixed step:
    its call also writes the low-precision params, and off the CPU reads the low-precision
    gradients itself). ``perleaf`` (the
    transform has a rule that reduces within a leaf): a program neither covers takes the
    per-leaf tier when it can."""
    if any(getattr(op, "perleaf", False) for op in program):
        found: _KernelPlan | str = _perleaf.match(program, _KernelPlan)
        return found
    plan = _match_kernel(program)
    if compiled and (compiled_first or isinstance(plan, str)):
        # (else a PyTorch kernel where one covers the program: as fast as the compiled
        # call over laid-out tensors, and faster than one that gathers separate ones)
        alternative = _match_compiled(program)
        if isinstance(alternative, _KernelPlan):
            return alternative
        if isinstance(plan, str):
            plan = f"{plan}, and {alternative}"
    if isinstance(plan, str) and perleaf:
        alternative = _perleaf.match(program, _KernelPlan)
        plan = alternative if isinstance(alternative, _KernelPlan) else (
            f"{plan}, and {alternative}")
    return plan


def _matches(programs: list[list[Any]], compiled: bool, perleaf: bool,
             compiled_first: bool = False,
             ) -> list[tuple[_KernelPlan | str, tuple[Any, ...] | None]]:
    """Per program, `match`'s plan (or reason) and the plan's key (None with a reason).
    Programs of the same rules in the same order (the same nodes, clips and guards) differ
    only in their rules' per-leaf state entries: each such run is matched once, and the
    others take its plan with their own rules in the fields that hold such entries."""
    seen: dict[tuple[Any, ...], tuple[Any, Any, dict[str, Any]]] = {}
    out: list[tuple[_KernelPlan | str, tuple[Any, ...] | None]] = []
    for program in programs:
        signature = tuple([op.node if type(op) is _Op else op for op in program])
        found = seen.get(signature)
        if found is None:
            plan = match(program, compiled, perleaf, compiled_first)
            key = None if isinstance(plan, str) else plan.key()
            # (the positions in the program of the plan's rules with per-leaf entries)
            at: dict[str, Any] = {}
            if not isinstance(plan, str):
                for name in ("adam", "decay", "trace"):
                    op = getattr(plan, name)
                    if op is not None and op.slots:
                        at[name] = next(j for j, x in enumerate(program) if x is op)
                if any(op.slots for op in plan.ops):
                    at["ops"] = [next(j for j, x in enumerate(program) if x is op)
                                 for op in plan.ops]
            seen[signature] = (plan, key, at)
            out.append((plan, key))
            continue
        plan, key, at = found
        if at:
            plan = plan.at(**{name: tuple(program[j] for j in js) if name == "ops"
                              else program[js] for name, js in at.items()})
        out.append((plan, key))
    return out


def _match_compiled(program: list[Any]) -> _KernelPlan | str:
    """The compiled tier for a program of elementwise rules after an optional leading
    ``apply_if_finite`` and clip, or the reason it has none."""
    ops = [op for op in program if op.kind != "identity"]
    guard = ops.pop(0) if ops and isinstance(ops[0], _Guard) else None
    clip = ops.pop(0) if ops and isinstance(ops[0], _Clip) else None
    for op in ops:
        if isinstance(op, (_Guard, _Clip)):
            return f"the compiled tier takes {op.kind} only before the rules, not after them"
        if op.kind == "set_to_zero":
            return "the compiled tier has no set_to_zero after other rules"
        if op.perleaf:
            return f"{op.kind} is not elementwise (the per-leaf tier takes it)"
        if op.fn is None or op.state_at is None:
            return f"the compiled tier has no lowering of {op.kind}"
        if op.injected and op.rebuild is None:
            return (f"the compiled tier does not find {op.kind} again in the injected "
                    f"transform built from a step's values")
    if not ops:
        return "no update rule"
    summing = [op.kind for op in ops if op.sums is not None]
    if len(summing) > 1:
        return (f"the compiled tier takes one rule with tree sums per program, not "
                f"{' and '.join(summing)}")
    if summing and any(op.injected for op in ops):
        return (f"the compiled tier does not lower {summing[0]} with inject_hyperparams "
                f"(the tree sums' pass reads the rules built at planning)")
    return _KernelPlan("compiled", clip, guard=guard, ops=tuple(ops))


def _match_kernel(program: list[Any]) -> _KernelPlan | str:
    """The PyTorch kernel for one leaf's program, or the reason there is none."""
    ops = [op for op in program if op.kind != "identity"]
    leading = _leading_marks(ops)
    if isinstance(leading, str):
        return leading
    guard, clip = leading
    # torch.optim's maximize: the gradient negated first (then decayed, then the rule)
    first = ops[0].args.get("step_size") if ops and ops[0].kernel == "scale" else None
    maximize = isinstance(first, _Const) and _is_number(first.value) and first.value == -1
    if maximize:
        ops.pop(0)
    kinds = tuple(op.kind for op in ops)  # (for the messages; ``parts`` for the patterns)
    parts = tuple(op.kernel for op in ops)
    if not kinds:
        return "no update rule (the updates would be the gradients themselves)"
    if "clip_by_global_norm" in kinds:
        before = kinds[kinds.index("clip_by_global_norm") - 1]
        return (f"clip_by_global_norm after {before} has no fused form (only a leading clip "
                f"folds into the kernel)")
    if "zero" in parts:
        if parts[-1] != "zero":
            return "set_to_zero followed by other rules"
        if any(op.kind != "identity" for op in ops[:-1]) or maximize:
            # the rules before still advance their state (moments, counts) on the pure path
            return "set_to_zero after other rules (their state advances; the kernels write none)"
        return _KernelPlan("zero", None, guard=guard)
    if parts[-1] not in _LR_KINDS:
        return f"the program {' -> '.join(kinds)} does not end with a learning rate"
    lr = _learning_rate(ops[-1])
    if lr is None:
        return f"{kinds[-1]} with a positive factor (ascent) has no fused kernel"
    body = _body_rules(ops[:-1])
    if isinstance(body, str):
        return body
    if body is not None:
        kernel, adam, decay, trace = body
        return _KernelPlan(kernel, clip, adam=adam, decay=decay, trace=trace, lr=lr,
                           guard=guard, maximize=maximize)
    unknown = next((op.kind for op in ops if op.kernel is None and not op.perleaf
                    and op.kind not in ("apply_if_finite", "clip_by_global_norm")), None)
    if unknown is not None:
        return f"{unknown} has no fused kernel"
    return f"the program {' -> '.join(kinds)} matches no fused kernel"


def _leading_marks(ops: list[Any]) -> tuple[_Guard | None, _Clip | None] | str:
    """A program's leading ``apply_if_finite`` and clip, taken off ``ops`` (each the
    kernels fold in: the guard into their skip, the clip into their ``grad_scale``), or
    the reason one elsewhere has no fused form."""
    guard = ops.pop(0) if ops and isinstance(ops[0], _Guard) else None
    for i, op in enumerate(ops):
        if isinstance(op, _Guard):
            return (f"apply_if_finite after {ops[i - 1].kind} has no fused form (only one "
                    f"around the whole rule folds into the kernel's skip)")
    clip = ops.pop(0) if ops and isinstance(ops[0], _Clip) else None
    for i, op in enumerate(ops):
        if isinstance(op, _Clip):
            before = ops[i - 1].kind if i else "another clip"
            return (f"clip_by_global_norm after {before} has no fused form (only a leading "
                    f"clip folds into the kernel)")
    return guard, clip


_MOMENTS = ("adam", "amsgrad")  # the kernel parts of the fused Adam kernels' moments
# the kernel parts before the learning rate that torch._fused_sgd_ computes
_SGD_BODIES = ((), ("momentum",), ("weight_decay",), ("weight_decay", "momentum"),
               ("dampened_momentum",), ("weight_decay", "dampened_momentum"))


def _body_rules(ops: list[_Op]) -> tuple[str, _Op | None, _Op | None, _Op | None] | str | None:
    """The kernel of the rules before a learning rate and its (adam, decay, trace) rules,
    the reason the kernel cannot take them, or None where no kernel has their pattern."""
    body = tuple(op.kernel for op in ops)
    # Adam with decoupled decay after the moments (AdamW), or L2 decay before them (Adam's
    # weight_decay, torch._fused_adam_'s): the same moments, two kernels
    l2 = len(body) == 2 and body[0] == "weight_decay" and body[1] in _MOMENTS
    if l2 or (body and body[0] in _MOMENTS and body[1:] in ((), ("weight_decay",))):
        adam = ops[1] if l2 else ops[0]
        if adam.kernel == "amsgrad" and not adam.args["torch_variant"].value:
            return ("scale_by_amsgrad (optax's variant, the max of corrected moments) has no "
                    "fused kernel; correct_after_max=True is torch's, which has")
        if adam.args["nesterov"].value:
            return "scale_by_adam(nesterov=True) (NAdam) has no fused kernel"
        if _python(adam.args["eps_root"]) not in (None, 0):
            return "scale_by_adam(eps_root > 0) has no fused kernel"
        decay = ops[0] if l2 else (ops[1] if len(ops) == 2 else None)
        return "adam" if l2 else "adamw", adam, decay, None
    if body in _SGD_BODIES:
        decay = ops[0] if body and body[0] == "weight_decay" else None
        trace = ops[-1] if body and body[-1] in ("momentum", "dampened_momentum") else None
        return "sgd", None, decay, trace
    return None


@dataclass
class Group:
    """Leaves that take one kernel call (one compiled call for the compiled tier)."""

    plan: _KernelPlan  # the first leaf's (the kernel and its bindings are the group's)
    device: torch.device
    dtype: torch.dtype
    leaves: list[int]
    plans: list[_KernelPlan]  # per leaf: its own state entries

    _slots: dict[tuple[str, str], list[int]] = field(default_factory=dict)

    @functools.cached_property
    def on_cpu(self) -> bool:
        return self.device.type == "cpu"

    def slots(self, op: str, slot: str) -> list[int]:
        """The flat state indices of ``slot`` of the rule ``op`` ("adam", "trace")."""
        found = self._slots.get((op, slot))
        if found is None:
            found = self._slots[(op, slot)] = [getattr(plan, op).slots[slot]
                                               for plan in self.plans]
        return found


# Plain tensors: each its own local shard, whose identity and version counter `_Steady`
# trusts (a subclass may hold values elsewhere).
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _layout_problem(plan: _KernelPlan, v: Any, state_leaves: list[Any]) -> str | None:
    """Why the leaf of value ``v`` cannot take its plan's call at this step, or None."""
    if plan.kernel == "zero":
        return None
    if plan.kernel == "perleaf":
        return _perleaf.layout_problem(plan, v, state_leaves)
    local = local_tensor(v)
    if plan.kernel == "compiled":
        return _compiled.layout_problem(plan, local, state_leaves)
    if local.dtype not in _KERNEL_DTYPES:
        return f"{local.dtype} has no fused kernel"
    if plan.kernel == "sgd" and local.device.type == "cpu" and local.dtype not in (
            _SGD_CPU_DTYPES):
        return (f"torch._fused_sgd_ is wrong for {local.dtype} on the CPU in this torch "
                f"(pytorch/pytorch#191763)")
    ops = [op for op in (plan.adam, plan.trace) if op is not None]
    if not _lined_up(ops, local, state_leaves):  # (else dense, with entries laid out as it)
        if not _dense(local):
            return f"its layout (strides {local.stride()}) is not dense"
        problem = _compiled.entries_problem(ops, local, state_leaves, same_dtype=True)
        if problem is not None:
            return problem
    if plan.trace is not None and _python(plan.trace.args["decay"]) == 0:
        return ("trace(decay=0) keeps a trace equal to the gradient, which "
                "torch._fused_sgd_ does not write without momentum")
    return None


def _lined_up(ops: list[_Op], local: torch.Tensor, state_leaves: list[Any]) -> bool:
    """Whether ``local`` is contiguous and each per-leaf state entry of ``ops`` a plain
    tensor of its dtype, shape, strides and device: the layout nearly every leaf has,
    checked in a few reads (`_compiled.entries_problem` finds the problem otherwise)."""
    if not local.is_contiguous():
        return False
    dtype, shape, stride, device = local.dtype, local.shape, local.stride(), local.device
    for op in ops:
        for k in op.slots.values():
            s = state_leaves[k]
            if type(s) not in _PLAIN or s.dtype != dtype or s.shape != shape or (
                    s.stride() != stride or s.device != device):
                return False
    return True


def _python(binding: Any) -> Any:
    return binding.value if isinstance(binding, _Const) else None


def _owned(xs: list[Any], donate: bool) -> list[torch.Tensor]:
    if donate:  # (a plain tensor is its own shard: no call per leaf)
        return [x if type(x) in _PLAIN else local_tensor(x) for x in xs]
    return [local_tensor(x).clone() for x in xs]


def _kernel_grads(grads: list[Any], values: list[torch.Tensor], owned: bool,
                  needs_write: bool) -> list[torch.Tensor]:
    """The gradients a kernel call reads: in their values' layout (a copy otherwise), and
    copies the kernel may write when it unscales in place and the caller keeps them."""
    out = []
    for g, v in zip(grads, values, strict=True):
        local = g if type(g) in _PLAIN else local_tensor(g)
        if local.stride() != v.stride() and local.numel() > 1:
            local = torch.empty_like(v).copy_(local)
        elif needs_write and not owned:
            local = local.clone()
        out.append(local)
    return out


def _hyperparameters(plan: _KernelPlan, env: _Env) -> dict[str, Any] | str:
    """The kernel's arguments at this step (Python floats, the lr possibly a 0-d tensor), or
    the reason a value read now has no fused form."""
    if plan.kernel == "perleaf":
        # the rules' own updates read their hyperparameters; an injected rule's are taken
        # from the inner transform built with this step's values (in the tier's run), so
        # nothing resolved here may be kept for the next step
        if any(op.rebuild is not None for op in plan.ops):
            env.volatile = True
        return {}
    if plan.kernel == "compiled":
        # the rules' own updates, which read their hyperparameters; an injected rule's from
        # the inner transform built with this step's values, as inject_hyperparams does
        return {"updates": [op.fn if op.rebuild is None else env.spec_of(op.rebuild).update
                            for op in plan.ops]}
    lr = plan.lr(env)
    if isinstance(lr, torch.Tensor) and lr.device.type == "cpu" and lr.dim() == 0 and (
            not _ops._recording()):
        # a host tensor (an injected lr) is read for free, once while unchanged: the
        # kernels then take the float, which costs less per call than a tensor lr
        lr = env.number(lr)
    hp: dict[str, Any] = {"lr": lr, "weight_decay": 0.0 if plan.decay is None
                          else env.number(plan.decay.args["weight_decay"](env))}
    if plan.kernel in ("adamw", "adam"):
        adam = plan.adam
        assert adam is not None
        if env.number(adam.args["eps_root"](env)) != 0.0:
            return "an injected eps_root other than 0 has no fused kernel"
        hp.update(beta1=env.number(adam.args["b1"](env)),
                  beta2=env.number(adam.args["b2"](env)), eps=env.number(adam.args["eps"](env)))
    else:
        trace = plan.trace
        hp["momentum"] = 0.0 if trace is None else env.number(trace.args["decay"](env))
        hp["nesterov"] = False if trace is None else bool(trace.args["nesterov"].value)
        hp["dampening"], hp["is_first_step"] = 0.0, False
        if trace is not None and trace.kernel == "dampened_momentum":
            # a dampened trace starts as the gradient itself (torch.optim.SGD's first step):
            # the kernel's is_first_step, a Python bool, so the count is read on the host
            # (free for a CPU count; one synchronisation per step elsewhere)
            assert trace.count is not None
            if _ops._recording():
                return ("a dampened trace's first step is torch._fused_sgd_'s is_first_step, "
                        "a Python bool read from the count on the host, which a recorded "
                        "step cannot read")
            hp["dampening"] = env.number(trace.args["dampening"](env))
            env.volatile = True
            hp["is_first_step"] = int(env.leaves[trace.count]) == 0
        if trace is not None and hp["momentum"] == 0.0:
            return ("trace(decay=0) (here an injected momentum of 0) keeps a trace equal to "
                    "the gradient, which torch._fused_sgd_ does not write without momentum")
    return hp


def _kernel_scale(scale: torch.Tensor | None, device: torch.device, dtype: torch.dtype,
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None, bool]:
    """A clip factor as the kernels take it: the factor (None where it does not act), the
    kernels' ``grad_scale`` (its float32 reciprocal, or None), and whether the gradients
    are instead multiplied by the factor in their own dtype before the kernel."""
    if scale is None or (_ops._host_branch_ok(scale) and scale.item() == 1.0):
        # no clip, or one that does not act at this step (a norm within its bound), read
        # for free on the CPU: the kernel reads the gradients as they are (g / 1 is g)
        return None, None, False
    grad_scale = scale.reciprocal().to(device=device, dtype=torch.float32)
    # the kernels take grad_scale in float32: a float64 group, or a divisor beyond float32
    # (a clip of a norm above 3.4e38; a free host read on the CPU, elsewhere such a norm
    # divides the gradients to zero), is scaled as the pure path scales
    widened = dtype == torch.float64 or (
        _ops._host_branch_ok(grad_scale) and not math.isfinite(grad_scale.item())
        and math.isfinite(scale.item()))
    return scale, None if widened else grad_scale, widened


def _run_group(group: Group, hp: dict[str, Any], values: list[Any], grads: list[Any],
               state_leaves: list[Any], new_values: list[Any], new_leaves: list[Any], *,
               donate: bool, donate_grads: bool, scale: torch.Tensor | None,
               found_inf: torch.Tensor | None, advanced: dict[int, torch.Tensor],
               hosted: dict[int, int], compiled: dict[Any, Any],
               workspace: dict[Any, Any] | None,
               totals: dict[int, Any] | None = None,
               low: list[Any] | None = None, new_low: list[Any] | None = None,
               checked: bool = False) -> None:
    """One kernel call for the leaves of ``group`` (``checked``: see `run`)."""
    if group.plan.kernel == "compiled":
        _compiled.run_group(group, values, grads, state_leaves, new_values, new_leaves,
                            hp["updates"], donate=donate, scale=scale, found_inf=found_inf,
                            compiled=compiled, workspace=workspace, totals=totals, low=low,
                            new_low=new_low)
        return
    plan, idx, device, dtype = group.plan, group.leaves, group.device, group.dtype
    # (checked and donated: plain tensors, their own shards, each gradient laid out as its
    # value and not written without a scale: _owned and _kernel_grads would return them)
    plain = checked and donate
    p = [values[i] for i in idx] if plain else _owned([values[i] for i in idx], donate)
    scale, grad_scale, widened = _kernel_scale(scale, device, dtype)
    # a kernel that unscales in place on the CPU, on gradients the caller keeps: copied
    # batch by batch into a small scratch buffer (`_staged`), if their layouts allow it
    staged = grad_scale is not None and not donate_grads and group.on_cpu
    local = [grads[i] if plain or type(grads[i]) in _PLAIN else local_tensor(grads[i])
             for i in idx] if staged else []

    def kernel_grads() -> list[torch.Tensor]:
        """The gradients of one kernel call over the whole group."""
        g = [grads[i] for i in idx] if plain and (donate_grads or scale is None) else (
            _kernel_grads([grads[i] for i in idx], p, donate_grads, scale is not None))
        if widened:
            assert scale is not None
            torch._foreach_mul_(g, scale.to(device=device, dtype=dtype))
        return g

    def launch(call: Callable[[list[torch.Tensor], list[list[torch.Tensor]]], None],
               columns: list[list[torch.Tensor]]) -> None:
        if staged and _staged.fits(local, columns):
            _staged.run(call, local, columns, workspace, ("staged", idx[0]))
        else:
            call(kernel_grads(), columns)

    flag = None if found_inf is None else found_inf.to(device=device, dtype=torch.float32)  # 1.0: skip
    lr_value = hp["lr"]
    lr: Any = (lr_value.to(device=device, dtype=torch.promote_types(dtype, torch.float32))
               if isinstance(lr_value, torch.Tensor) else float(lr_value))
    wd = hp["weight_decay"]
    written: list[tuple[list[int], list[torch.Tensor]]] = []
    if plan.kernel in ("adamw", "adam"):
        adam = plan.adam
        assert adam is not None
        mu_at, nu_at = group.slots("adam", "mu"), group.slots("adam", "nu")
        m, n = ([state_leaves[k] for k in at] if plain else _owned(
            [state_leaves[k] for k in at], donate) for at in (mu_at, nu_at))
        amsgrad = adam.kernel == "amsgrad"
        top = _owned([state_leaves[k] for k in group.slots("adam", "nu_max")], donate) if (
            amsgrad) else []
        assert adam.count is not None
        host = hosted.get(adam.count)
        # (the kernels take the count in float32; made from the host value when there is
        # one)
        step = (advanced[adam.count].to(device=device, dtype=torch.float32) if host is None
                else torch.scalar_tensor(float(host), dtype=torch.float32,
                                         device=None if group.on_cpu else device))
        kernel = torch._fused_adamw_ if plan.kernel == "adamw" else torch._fused_adam_

        def adam_call(g: list[torch.Tensor], c: list[list[torch.Tensor]]) -> None:
            kernel(c[0], g, c[1], c[2], c[3], [step] * len(g), lr=lr, beta1=hp["beta1"],
                   beta2=hp["beta2"], weight_decay=wd, eps=hp["eps"], amsgrad=amsgrad,
                   maximize=plan.maximize, grad_scale=grad_scale, found_inf=flag)

        launch(adam_call, [p, m, n, top])
        written = [(mu_at, m), (nu_at, n)]
        if amsgrad:
            written.append((group.slots("adam", "nu_max"), top))
    else:  # sgd
        trace = plan.trace
        bufs = [] if trace is None else _owned(
            [state_leaves[k] for k in group.slots("trace", "trace")], donate)
        momentum, nesterov = hp["momentum"], hp["nesterov"]
        # A zero momentum buffer makes the first step's ``momentum * 0 + g`` exactly the
        # ``buf = g`` of is_first_step, so trace's zero-initialised buffer fits; a
        # dampened_trace says its first step (its count) instead.

        def sgd_call(g: list[torch.Tensor], c: list[list[torch.Tensor]]) -> None:
            torch._fused_sgd_(c[0], g, c[1], weight_decay=wd, momentum=momentum, lr=lr,
                              dampening=hp["dampening"], nesterov=nesterov,
                              maximize=plan.maximize, is_first_step=hp["is_first_step"],
                              grad_scale=grad_scale, found_inf=flag)

        launch(sgd_call, [p, bufs])
        if trace is not None:
            written = [(group.slots("trace", "trace"), bufs)]
    if not donate:  # donated leaves were written in place: the lists hold them
        for j, i in enumerate(idx):
            new_values[i] = _rewrap_like(values[i], p[j])
        for indices, tensors in written:
            for k, t in zip(indices, tensors, strict=True):
                new_leaves[k] = _rewrap_like(state_leaves[k], t)
