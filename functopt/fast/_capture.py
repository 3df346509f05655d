"""``Step.capture``: a step recorded once and replayed, as a CUDA graph.

A small model's step is mostly fixed cost: Python that checks, plans and launches a few
dozen kernels of microseconds each. A CUDA graph records the kernels of one step and
replays them with one launch; what it cannot record is anything the host decides while the
step runs. A step that is being recorded (`functopt.tree._ops._recording`: a CUDA stream
capture, or a Python dispatch mode such as the tape below) takes its device forms: its
counters advance by kernels, the learning rate reaches the kernels as a tensor (a schedule
of the count is computed on the device), and nothing is read back to branch on. What the
host resolved in the warm-up steps and keeps (the plan, hyperparameters the kernels take as
Python numbers) is recorded as it is, which is what it would be at every step.

A replay writes into the tensors it was recorded on: the step is donated, and the new
values the step returns where it does not write in place (the counters, a guard's
counters, injected hyperparameters) are copied into the old tensors inside the recording.
The user's params, gradients and state are then the graph's inputs and outputs: a
training loop calls ``backward()`` into the same gradient tensors and replays.

Two recorders share the recording step: the CUDA graph (``torch.cuda.CUDAGraph``) for CUDA
tensors, and, for tests on any device, a tape of the step's operations (`_Tape`: every
ATen call with its arguments, replayed in order on the tensors it was recorded on) that
refuses a value read back to the host, as a CUDA graph cannot record one either. The tape
is how ``functopt.testing.check_capture`` holds a captured step to the pure path on a CPU.
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.utils import _pytree
from torch.utils._python_dispatch import TorchDispatchMode

from functopt._base import Params, State, Updates
from functopt._collective.dtensor import _leaf_names
from functopt.fast import _planner
from functopt.fast._errors import CaptureError
from functopt.tree import _core

__all__ = ["CapturedStep", "Recordable", "capture", "written_back"]

_DEFAULT_WARMUP = 2


class Recordable(Protocol):
    """What `capture` uses of a step (a [`Step`][functopt.fast.Step]): its call, its
    donation flags, and its per-thread workspace, whose gather buffers the recording owns."""

    donate: bool
    donate_grads: bool
    _workspace: Any

    def __call__(self, grads: Updates, state: State, params: Params) -> Any: ...


class CapturedStep:
    """A recorded step ([`Step.capture`][functopt.fast.Step.capture]): ``captured()``
    replays it on the params, gradients and state it was recorded on, updating the params
    and the state in place; ``captured(grads)`` first copies each gradient that is not the
    recorded tensor into it. Holds the graph and the tensors it reads and writes.

    Attributes:
        params, grads, state: the trees it was recorded on (the same objects the caller
            passed; the replays update their tensors).

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.sgd(0.5)
        >>> step = functopt.fast.make_step(tx, donate=True)
        >>> device = "cuda" if torch.cuda.is_available() else "cpu"
        >>> params = {"w": torch.ones(2, device=device)}
        >>> grads = {"w": torch.ones(2, device=device)}
        >>> if device == "cuda":
        ...     captured = step.capture(grads, tx.init(params), params)
        ...     captured(); captured()  # two replays: two steps, in place
        ... else:  # (no CUDA: the same two steps, called)
        ...     state = tx.init(params)
        ...     for _ in range(2):
        ...         params, state = step(grads, state, params)
        >>> params["w"].tolist()
        [0.0, 0.0]
    """

    def __init__(self, replay: Callable[[], None], params: Params, grads: Updates,
                 state: State, treespec: _core.TreeSpec, grad_leaves: list[Any],
                 keep: Any) -> None:
        self._replay = replay
        self.params = params
        self.grads = grads
        self.state = state
        self._treespec = treespec
        self._grad_leaves = grad_leaves
        self._keep = keep  # what the recording reads and writes besides the trees

    def __repr__(self) -> str:
        return f"CapturedStep({self._treespec.num_leaves} leaves)"

    def __call__(self, grads: Updates | None = None) -> None:
        if grads is not None:
            self._load(grads)
        self._replay()

    def _load(self, grads: Updates) -> None:
        """Copy the gradients that are not the recorded tensors into them."""
        leaves = _core.flatten_like(self._treespec, grads, name="grads",
                                    reference="the captured grads")
        name = _leaf_names(self._treespec)
        for i, (g, static) in enumerate(zip(leaves, self._grad_leaves, strict=True)):
            if g is static:
                continue
            if static is None or g is None or not isinstance(g, torch.Tensor) or (
                    g.shape != static.shape or g.dtype != static.dtype
                    or g.device != static.device):
                raise ValueError(
                    f"captured step: grad {name(i)!r} is {_core._describe(g)}, where the "
                    f"step was recorded with {_core._describe(static)}. A replay reads the "
                    f"recorded gradient tensors: pass gradients of the same shapes, dtypes "
                    f"and devices (and the same None leaves), or capture again.")
            with torch.no_grad():
                static.copy_(g)


def capture(step: Recordable, grads: Updates, state: State, params: Params, *,
            warmup: int = _DEFAULT_WARMUP, tape: bool = False) -> CapturedStep:
    """`Step.capture`; ``tape``: record with `_Tape` instead of a CUDA graph (any device)."""
    if not step.donate:
        raise ValueError(
            "Step.capture: a captured step updates the params and the state in place, so "
            "it needs a donated step. Fix: functopt.fast.make_step(tx, donate=True).")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        raise ValueError(
            f"Step.capture: warmup must be an int >= 1 (real steps before recording, then "
            f"undone), got {warmup!r}.")
    param_leaves, treespec = _core.flatten(params)
    grad_leaves = _core.flatten_like(treespec, grads, name="grads", reference="params")
    state_leaves, state_spec = _core.flatten(state)
    name = _leaf_names(treespec)
    device = _check_inputs(param_leaves, grad_leaves, state_leaves, state_spec, name,
                           tape=tape)

    def program() -> None:
        # (a donated step being recorded returns its inputs, updated in place: `Step._kept`)
        step(grads, state, params)

    # The warm-up steps are real steps (the first plans, compiles, allocates the kernels'
    # workspace): what they change is put back, so that capture leaves every value as it
    # was. Only the tensors whose bits changed are restored: the others keep their version
    # counters, by which the step knows that what it resolved from them (an injected
    # constant) still holds. (The bits, not the version counters: the fused kernels write
    # in place without advancing them.)
    written = [t for t in (*param_leaves, *state_leaves,
                           *(grad_leaves if step.donate_grads else ()))
               if isinstance(t, torch.Tensor)]
    # The compiled tier's gather buffers (scratch of a donated step, per thread) are the
    # recording's own: a later direct call of the step in this thread, which may replace
    # its buffers, cannot move memory the replays write.
    workspace: dict[Any, Any] = {}
    previous = getattr(step._workspace, "buffers", None)
    step._workspace.buffers = workspace
    try:
        replay, keep = _record(program, written, device, warmup, tape)
    finally:
        if previous is None:
            del step._workspace.buffers
        else:
            step._workspace.buffers = previous
    return CapturedStep(replay, params, grads, state, treespec, grad_leaves,
                        (keep, step, workspace))


def _record(program: Callable[[], None], written: list[torch.Tensor],
            device: torch.device | None, warmup: int, tape: bool,
            ) -> tuple[Callable[[], None], Any]:
    with torch.no_grad():
        saved = [(t, t.clone()) for t in _unique(written)]

        def restore() -> None:
            for t, copy in saved:
                if not _same_bits(t, copy):
                    t.copy_(copy)

        if not tape:
            graph = _cuda_graph(program, device, warmup, restore)
            return graph.replay, graph
        for _ in range(warmup):
            program()
        restore()
        recorder = _Tape()
        with recorder:
            program()
        restore()  # (the tape's recording ran the step; a CUDA graph's does not)
        return recorder.replay, recorder


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (one shape and dtype) hold the same bits (a nan is its own
    bits, and 0.0 is not -0.0)."""
    if a.numel() == 0:
        return True
    def bits(x: torch.Tensor) -> torch.Tensor:
        return torch.empty(x.numel(), dtype=x.dtype, device=x.device).copy_(
            x.reshape(-1)).view(torch.uint8)

    return torch.equal(bits(a), bits(b))


def _unique(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _state_names(state_spec: _core.TreeSpec) -> Callable[[int], str]:
    paths = _core.paths(state_spec)
    return lambda i: paths[i] or "state"


def written_back(param_leaves: list[Any], treespec: _core.TreeSpec, state_leaves: list[Any],
                 state_spec: _core.TreeSpec, values: list[Any], leaves: list[Any],
                 spec: _core.TreeSpec) -> tuple[list[Any], list[Any], _core.TreeSpec]:
    """The inputs of a donated step being recorded, each new tensor of its results
    (``values``: the new params; ``leaves`` and ``spec``: the new state) copied into the
    tensor it replaces (see `Step._kept`): a replay then writes where the next replay
    reads."""
    if spec != state_spec:
        raise CaptureError(
            f"a recorded step changed the structure of its state (from {state_spec} to "
            f"{spec}); a replay writes into the tensors it was recorded on. Fix: record "
            f"a step after one that made the state its steady structure.")
    _written_back(param_leaves, values, _leaf_names(treespec), "param")
    _written_back(state_leaves, leaves, _state_names(state_spec), "state entry")
    return param_leaves, state_leaves, state_spec


def _written_back(old: list[Any], new: list[Any], name: Callable[[int], str], what: str,
                  ) -> None:
    """Copy each new tensor of ``new`` into the tensor of ``old`` it replaces."""
    for i, (a, b) in enumerate(zip(old, new, strict=True)):
        if b is a:
            continue
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and (
                a.shape == b.shape and a.dtype == b.dtype and a.device == b.device):
            a.copy_(b)
        elif not (isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor)) and a == b:
            continue
        else:
            raise CaptureError(
                f"a recorded step replaces {what} {name(i)!r}, {_core._describe(a)}, with "
                f"{_core._describe(b)}; a replay can only write new values into the tensors "
                f"it was recorded on. Fix: give that entry its steady kind before recording "
                f"(one step first), or step without capture.")


def _check_inputs(param_leaves: list[Any], grad_leaves: list[Any], state_leaves: list[Any],
                  state_spec: _core.TreeSpec, name: Callable[[int], str], *,
                  tape: bool) -> torch.device | None:
    """The CUDA device every tensor is on (None for a tape); raises for a tensor that is not
    a plain tensor on it, a param without a gradient tensor."""
    state_name = _state_names(state_spec)
    rows = [(f"param {name(i)!r}", p) for i, p in enumerate(param_leaves)]
    rows += [(f"grad {name(i)!r}", g) for i, g in enumerate(grad_leaves)]
    rows += [(f"state entry {state_name(i)!r}", x) for i, x in enumerate(state_leaves)]
    rows = [(what, x) for what, x in rows if isinstance(x, torch.Tensor)]
    for what, x in rows:
        if type(x) not in (torch.Tensor, torch.nn.Parameter):
            raise TypeError(
                f"Step.capture: {what} is a {type(x).__name__}; a captured step takes plain "
                f"tensors (a DTensor's collectives are not recorded here). Fix: step it "
                f"without capture.")
    pair = _planner.overlap([x for _, x in rows], lambda i: rows[i][0], "tensor")
    if pair is not None:
        raise ValueError(
            f"Step.capture: {rows[pair[0]][0]} and {rows[pair[1]][0]} share memory; a replay "
            f"writes each param and state entry in its own memory, so one would overwrite "
            f"the other (tied params are refused by a donated step too). Fix: give each its "
            f"own tensor (x.clone()), or step without capture.")
    device: torch.device | None = None
    for what, x in [] if tape else rows:
        if x.device.type != "cuda":
            raise ValueError(
                f"Step.capture: {what} is on {x.device}; a CUDA graph records the work of "
                f"one CUDA device, and a value on the host (a counter on the CPU, as "
                f"MultiSteps keeps its window) would stay what it was when recorded. Fix: "
                f"put the params, their gradients and the state (tx.init of CUDA params) on "
                f"one CUDA device, or step without capture.")
        if device is None:
            device = x.device
        elif x.device != device:
            raise ValueError(
                f"Step.capture: {what} is on {x.device}, another device than {device}; a "
                f"CUDA graph records the work of one device. Fix: put everything on one.")
    for i, (p, g) in enumerate(zip(param_leaves, grad_leaves, strict=True)):
        if p is not None and g is None:
            raise ValueError(
                f"Step.capture: param {name(i)!r} has no gradient tensor; a replay reads "
                f"the gradients recorded, so a gradient that appears later would not be "
                f"read. Fix: give every param its gradient tensor before capture (a "
                f"backward pass, with model.zero_grad(set_to_none=False) between steps), "
                f"or leave the param out of the tree.")
    if not tape and device is None:
        raise ValueError("Step.capture: the params hold no tensor to record a step on.")
    return device


def _cuda_graph(program: Callable[[], None], device: torch.device | None, warmup: int,
                restore: Callable[[], None]) -> Any:  # pragma: no cover - needs CUDA
    """The recording as a ``torch.cuda.CUDAGraph``: the warm-up steps on a side stream (as
    CUDA graphs want), their changes restored, then the recorded step."""
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    side.wait_stream(current)
    with torch.cuda.stream(side):
        for _ in range(warmup):
            program()
    current.wait_stream(side)
    restore()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        program()
    return graph


# --- the tape --------------------------------------------------------------------------------

# The operations that read a tensor's elements back to the host (``.item()``, ``int(t)``,
# ``float(t)``, ``bool(t)``, ``torch.equal``): a CUDA graph cannot record them.
_HOST_READS = frozenset({torch.ops.aten._local_scalar_dense, torch.ops.aten.equal,
                         torch.ops.aten.is_nonzero, torch.ops.aten.allclose})


class _Made:
    """An argument that an earlier operation of the tape made: its ``position``-th output
    tensor of operation ``op``."""

    __slots__ = ("op", "position")

    def __init__(self, op: int, position: int) -> None:
        self.op, self.position = op, position


class _Tape(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """A step's ATen operations, recorded with their arguments (the tensors it did not make
    held as they are, the ones it made by where they were made, every other argument as its
    value) and replayed in order: what a CUDA graph does with kernels. An operation that
    reads a value back to the host (``.item()``, ``int(t)``, ``bool(t)``) raises
    `CaptureError`, which names the line of functopt or of the caller that read it."""

    replays = True  # (what `functopt.tree._ops._recording` looks for)

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops: list[tuple[Any, Any, Any]] = []
        self.made: dict[int, _Made] = {}
        self.held: list[torch.Tensor] = []  # every tensor seen: their ids stay unique

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.overloadpacket in _HOST_READS:
            raise CaptureError(
                f"a captured step read a tensor's value on the host ({func}, as .item(), "
                f"int(), float() or bool() of a tensor do){_where()}; a replay would keep "
                f"the value read when recorded. Fix: compute it on the device "
                f"(torch.where), or step without capture.")
        out = func(*args, **kwargs)
        outputs = _pytree.tree_leaves(out)
        template = (_pytree.tree_map(self._argument, args),
                    _pytree.tree_map(self._argument, kwargs))
        index = len(self.ops)
        self.ops.append((func, *template))
        for position, x in enumerate(outputs):
            if isinstance(x, torch.Tensor):
                self.made[id(x)] = _Made(index, position)
                self.held.append(x)
        return out

    def _argument(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            made = self.made.get(id(x))
            if made is not None:
                return made
            self.held.append(x)
        return x

    @functools.cached_property
    def _last(self) -> dict[int, int]:
        """Per operation whose outputs are read, the last operation that reads them."""
        last: dict[int, int] = {}
        for j, (_, args, kwargs) in enumerate(self.ops):
            for x in _pytree.tree_leaves((args, kwargs)):
                if isinstance(x, _Made):
                    last[x.op] = j
        return last

    def replay(self) -> None:
        last = self._last
        results: dict[int, list[Any]] = {}

        def resolve(x: Any) -> Any:
            return results[x.op][x.position] if isinstance(x, _Made) else x

        with torch.no_grad():
            for j, (func, args, kwargs) in enumerate(self.ops):
                out = func(*_pytree.tree_map(resolve, args), **_pytree.tree_map(resolve, kwargs))
                if last.get(j, -1) > j:
                    results[j] = _pytree.tree_leaves(out)
                for k in [k for k in results if last[k] <= j]:
                    del results[k]  # (freed where the eager step frees it)


def _where() -> str:
    """`` at file:line`` of the innermost frame outside this module and torch."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/torch/" not in frame.filename and frame.filename != __file__:
            return f" at {frame.filename}:{frame.lineno} ({frame.name})"
    return ""
