"""``Step.capture``: a step recorded once and replayed (functopt/fast/_capture.py).

On this machine there is no CUDA: the law (``conformance.check_capture``) records the step
on the tape of its operations, which replays them with the arguments of the recording and
refuses a value read back to the host, as a CUDA graph does. The CUDA cases at the end run
where a GPU is.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings

import functopt
from functopt.fast import CaptureError, _capture
from functopt.schedules import linear_schedule, warmup_cosine_decay_schedule
from functopt.testing import conformance

F = functopt

# Chains a user composes, one per planner path: the kernels, with a folded clip and guard,
# masks, partitions, injected and scheduled learning rates; the per-leaf tier; and a chain
# without a fast path, whose pure update is recorded.
CHAINS: dict[str, Callable[[], functopt.GradientTransformation]] = {
    "adamw": lambda: F.adamw(1e-2, weight_decay=0.1),
    "adam_l2": lambda: F.chain(F.add_decayed_weights(0.01), F.adam(1e-2)),
    "amsgrad_torch": lambda: F.chain(F.scale_by_amsgrad(correct_after_max=True),
                                     F.scale_by_learning_rate(1e-2)),
    "sgd_nesterov": lambda: F.sgd(0.1, momentum=0.9, nesterov=True),
    "clip_adamw_schedule": lambda: F.chain(
        F.clip_by_global_norm(0.5),
        F.adamw(warmup_cosine_decay_schedule(0.0, 0.1, 2, 10), weight_decay=0.01)),
    "masked_decay": lambda: F.adamw(1e-2, weight_decay=0.1,
                                    mask=lambda p: F.tree.map(lambda x: x.dim() > 1, p)),
    "injected_schedule": lambda: F.inject_hyperparams(F.adamw)(
        learning_rate=linear_schedule(0.1, 0.01, 5), weight_decay=0.01),
    "guarded": lambda: F.apply_if_finite(F.adam(1e-2), 2),
    "clip_then_guard": lambda: F.chain(F.clip_by_global_norm(1.0),
                                       F.apply_if_finite(F.adamw(1e-2), 3)),
    "zero_nans_clip": lambda: F.chain(F.zero_nans(), F.clip_by_global_norm(1.0),
                                      F.adamw(1e-2)),
    "lamb": lambda: F.lamb(1e-2),
    "lion_pure": lambda: F.lion(1e-3),
}


def _steps(grads: Any) -> list[Any]:
    """Three steps of gradients from one drawn tree: the tree, then other values in its
    layout (and the same non-finite entries)."""
    return [grads, *(F.tree.map(lambda g, k=k: g * k, grads) for k in (-0.5, 2.0))]


@pytest.mark.parametrize("name", sorted(CHAINS))
def test_the_law_over_drawn_trees(name: str) -> None:
    """Replayed, the recorded step equals the step called (bitwise) and the pure step, on
    every layout; tied params and params without a gradient are refused by name."""
    @settings(max_examples=8, deadline=None)
    @given(conformance.cases(max_leaves=4, dtypes=(torch.float32, torch.float64),
                             allow_none=False, tied=False))
    def law(case: tuple[Any, Any, Any]) -> None:
        params, grads, _ = case
        conformance.check_capture(CHAINS[name], params, _steps(grads))

    law()


@settings(max_examples=8, deadline=None)
@given(conformance.cases(max_leaves=4, dtypes=(torch.float32,)))
def test_tied_params_and_params_without_gradients_are_refused(
        case: tuple[Any, Any, Any]) -> None:
    """Drawn with ties and None gradients: the law then asks for a ValueError naming them
    (and no value written), where the trees have them."""
    params, grads, _ = case
    conformance.check_capture(CHAINS["adamw"], params, _steps(grads))


def _tree(dtype: torch.dtype = torch.float64) -> tuple[dict[str, torch.Tensor], ...]:
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(3, 4, generator=gen, dtype=dtype),
              "b": torch.randn(4, generator=gen, dtype=dtype)}
    grads = {k: torch.randn(v.shape, generator=gen, dtype=dtype) for k, v in params.items()}
    return params, grads


def test_schedules_and_skips_move_at_every_replay() -> None:
    """What changes from step to step (a warm-up schedule's learning rate, the bias
    corrections, a guard that skips a non-finite step and then gives up) comes from the
    device at each replay: ten replays equal ten pure steps."""
    params, grads = _tree()
    bad = F.tree.map(lambda g: g.clone().fill_(float("nan")), grads)
    sequence = [grads, bad, bad, bad, grads, *(F.tree.map(lambda g, k=k: g * k, grads)
                                              for k in (0.5, -1.0, 3.0, -2.0, 1.5))]
    conformance.check_capture(lambda: F.chain(
        F.clip_by_global_norm(0.5),
        F.apply_if_finite(F.adamw(warmup_cosine_decay_schedule(0.0, 0.1, 3, 10)), 2)),
        params, sequence)


def test_an_injected_learning_rate_written_in_place_reaches_the_replays() -> None:
    """The learning rate is read on the device at every replay: a scheduler that writes the
    injected value in place (as functopt.Optimizer's param_groups do) is followed."""
    params, grads = _tree()
    tx = F.inject_hyperparams(F.adamw)(learning_rate=0.1, weight_decay=0.0)
    step = F.fast.make_step(tx, donate=True)
    state = tx.init(params)
    captured = _capture.capture(step, grads, state, params, tape=True)
    state.hyperparams["learning_rate"].fill_(0.0)
    before = functopt.testing.clone_tree(params)
    captured()
    functopt.testing.assert_bitwise_equal(params, before)  # lr 0: nothing moves
    assert int(state.count) == 1  # the step ran
    state.hyperparams["learning_rate"].fill_(0.1)
    captured()
    assert all(not torch.equal(params[k], before[k]) for k in params)


def test_gradients_held_elsewhere_are_copied_in() -> None:
    params, grads = _tree()
    tx = F.adamw(1e-2)
    step = F.fast.make_step(tx, donate=True)
    state = tx.init(params)
    captured = _capture.capture(step, F.tree.map(torch.zeros_like, grads), state, params,
                                tape=True)
    expected_params, expected_state = F.fast.make_step(tx)(
        grads, tx.init(_tree()[0]), _tree()[0])
    captured(grads)
    functopt.testing.assert_bitwise_equal((params, state), (expected_params, expected_state))
    with pytest.raises(ValueError, match=r"grad 'w' is .*float32.*recorded with .*float64"):
        captured({"w": grads["w"].float(), "b": grads["b"]})


def test_a_value_read_on_the_host_is_refused_naming_the_line() -> None:
    """A transform that branches on a tensor's value cannot be replayed: capture says where
    it reads it (a CUDA graph would fail, or keep the branch of the recording)."""
    def doubled_where_positive() -> F.GradientTransformation:
        def scaled(g: torch.Tensor, p: Any) -> torch.Tensor:
            return g * 2 if float(g.sum()) > 0 else g
        return F.stateless(lambda u, p: F.tree.map(scaled, u, p))

    params, grads = _tree()
    tx = F.chain(doubled_where_positive(), F.sgd(0.1))
    step = F.fast.make_step(tx, donate=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", F.fast.FastPathWarning)
        with pytest.raises(CaptureError, match=r"on the host .* at .*test_capture\.py:\d+ "
                                               r"\(scaled\)"):
            _capture.capture(step, grads, tx.init(params), params, tape=True)


def test_multisteps_window_on_the_host_is_refused() -> None:
    """MultiSteps keeps its window in CPU counters and decides on the host."""
    params, grads = _tree()
    tx = F.MultiSteps(F.adamw(1e-2), every_k_schedule=2)
    step = F.fast.make_step(tx, donate=True)
    with pytest.raises(CaptureError, match=r"multi_steps\.py"):
        _capture.capture(step, grads, tx.init(params), params, tape=True)


def test_an_injected_beta_that_changes_is_refused() -> None:
    """The kernels take the betas as Python numbers: a beta that is a schedule of the count
    would be read on the host at every step."""
    params, grads = _tree()
    tx = F.inject_hyperparams(F.adamw)(learning_rate=0.1, b1=linear_schedule(0.9, 0.5, 4))
    step = F.fast.make_step(tx, donate=True)
    with pytest.raises(CaptureError, match="inject only the learning rate"):
        _capture.capture(step, grads, tx.init(params), params, tape=True)


def test_dampened_momentum_is_recorded_on_its_pure_update() -> None:
    """torch.optim.SGD's dampened momentum takes the kernel's is_first_step, a Python bool
    read from the count: a recorded step runs the pure update instead, which reads nothing
    on the host, and still equals the pure step."""
    params, grads = _tree()
    conformance.check_capture(lambda: F.chain(F.dampened_trace(0.9, dampening=0.5),
                                              F.scale_by_learning_rate(0.1)),
                              params, _steps(grads))


def test_bad_inputs_are_refused() -> None:
    params, grads = _tree()
    tx = F.adamw(1e-2)
    with pytest.raises(ValueError, match=r"needs a donated step.*donate=True"):
        F.fast.make_step(tx).capture(grads, tx.init(params), params)
    step = F.fast.make_step(tx, donate=True)
    with pytest.raises(ValueError, match="warmup must be an int >= 1"):
        step.capture(grads, tx.init(params), params, warmup=0)

    class Marked(torch.Tensor):
        pass

    odd = {"w": params["w"].as_subclass(Marked), "b": params["b"]}
    with pytest.raises(TypeError, match=r"param 'w' is a Marked"):
        step.capture(grads, tx.init(params), odd)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"param 'b' is on cpu.*one CUDA device"):
            step.capture(grads, tx.init(params), params)


# --- on a GPU --------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("name", ["adamw", "clip_adamw_schedule", "injected_schedule",
                                  "clip_then_guard", "lamb", "lion_pure"])
def test_cuda_graph_equals_the_step(name: str) -> None:
    params, grads = _tree(torch.float32)
    params, grads = (F.tree.map(lambda x: x.cuda(), t) for t in (params, grads))
    conformance.check_capture(CHAINS[name], params, _steps(grads))


@cuda
@pytest.mark.slow
def test_cuda_graph_of_the_compiled_tier() -> None:
    params, grads = _tree(torch.float32)
    params, grads = (F.tree.map(lambda x: x.cuda(), t) for t in (params, grads))
    conformance.check_capture(lambda: F.lion(1e-3), params, _steps(grads), compile=True)


@cuda
def test_cuda_capture_is_a_graph_and_refuses_host_counters() -> None:
    params, grads = _tree(torch.float32)
    params, grads = (F.tree.map(lambda x: x.cuda(), t) for t in (params, grads))
    tx = F.adamw(1e-2)
    step = F.fast.make_step(tx, donate=True)
    captured = step.capture(grads, tx.init(params), params)
    assert isinstance(captured._keep[0], torch.cuda.CUDAGraph)
    multi = F.MultiSteps(tx, every_k_schedule=2)
    with pytest.raises(ValueError, match=r"state entry .*mini_step.* is on cpu"):
        F.fast.make_step(multi, donate=True).capture(grads, multi.init(params), params)


# --- every built-in transform --------------------------------------------------------------

def _registry() -> list[Any]:
    from test_conformance import REGISTRY
    return REGISTRY


# The built-ins whose step reads a value on the host: refused with a CaptureError, never
# recorded wrong. (Kept exact: a transform that starts or stops reading the host fails here.)
HOST_READERS = {"MultiSteps"}


@pytest.mark.parametrize("entry", _registry(), ids=[e.id for e in _registry()])
def test_every_builtin_is_captured_or_refused(entry: Any) -> None:
    """Each public transform factory and recipe of the conformance registry, on a tree of
    three dtypes with a 0-d, an empty and a None leaf: its recorded step replays as the
    pure path steps, or capture refuses it with a CaptureError."""
    params = {"a": torch.linspace(-1, 1, 6).reshape(2, 3),
              "b": [torch.tensor(0.5, dtype=torch.float64), None],
              "c": torch.ones(0, dtype=torch.bfloat16)}
    grads = {"a": torch.linspace(0.5, -0.25, 6).reshape(2, 3),
             "b": [torch.tensor(-2.0, dtype=torch.float64), None],
             "c": torch.ones(0, dtype=torch.bfloat16)}
    try:
        conformance.check_capture(entry.factory, params, _steps(grads))
    except CaptureError:
        assert entry.name in HOST_READERS, f"{entry.id} cannot be captured"
    else:
        assert entry.name not in HOST_READERS, f"{entry.id} is captured now: update HOST_READERS"


@pytest.mark.parametrize("kind", ["Optimizer", "optim.AdamW"])
def test_an_optimizer_step_recorded_by_the_caller_replays(kind: str) -> None:
    """The PyTorch idiom: the caller records the whole ``opt.step()`` (as with
    ``torch.cuda.graph``) after a step has made the state. A donated step being recorded
    writes its new tensors (the counters) into those ``optimizer.state`` holds, so the
    replays go on from each other: they equal an optimizer stepped as it is recorded
    (its device forms: the learning rate a float32 tensor), bitwise."""
    import copy

    def make(params: Any) -> torch.optim.Optimizer:
        if kind == "Optimizer":
            return F.Optimizer(params, F.adamw(1e-2, weight_decay=0.1))
        return F.optim.AdamW(params, lr=1e-2, weight_decay=0.1)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    reference = copy.deepcopy(model)
    opt, ref = make(model.parameters()), make(reference.parameters())
    inputs = [torch.randn(5, 4) for _ in range(6)]

    def backward(m: torch.nn.Module, x: torch.Tensor) -> None:
        for p in m.parameters():  # (into the same gradient tensors, as a graph needs)
            if p.grad is not None:
                p.grad.zero_()
        m(x).square().sum().backward()

    for x in inputs[:2]:  # the state made, the step warmed up
        for m, o in ((model, opt), (reference, ref)):
            backward(m, x)
            o.step()
    tape = _capture._Tape()
    with tape:
        opt.step()  # (the tape's recording runs the step: so does the reference)
    with _capture._Tape():
        ref.step()
    for x in inputs[2:]:
        backward(model, x)
        backward(reference, x)
        tape.replay()
        with _capture._Tape():  # (a recording thrown away: the step as recorded)
            ref.step()
        functopt.testing.assert_bitwise_equal(
            [p.detach() for p in model.parameters()],
            [p.detach() for p in reference.parameters()])
        functopt.testing.assert_bitwise_equal(
            [dict(opt.state[p]) for p in model.parameters()],
            [dict(ref.state[p]) for p in reference.parameters()])


def test_the_mixed_precision_step_is_refused_while_recorded() -> None:
    """Its key (the step count seeding random rounding) lives on the CPU: a replay would
    not advance it, so a recording of it is refused, by name."""
    params = {"w": torch.ones(3, dtype=torch.bfloat16)}
    grads = {"w": torch.full((3,), 0.5, dtype=torch.bfloat16)}
    mp = F.precision.mixed_precision(F.adamw(1e-2), donate=True)
    state = mp.init(params)
    with pytest.raises(CaptureError, match="mixed-precision step cannot be recorded"), \
            _capture._Tape():
        mp.step(grads, state, params)


def test_a_dispatch_mode_that_only_observes_changes_nothing() -> None:
    """Under a dispatch mode that does not replay (a flop counter), a step that reads a
    changing hyperparameter on the host still runs, and equals the step outside it."""
    from torch.utils.flop_counter import FlopCounterMode

    params, grads = _tree()
    tx = F.inject_hyperparams(F.adamw)(learning_rate=0.1, b1=linear_schedule(0.9, 0.5, 4))
    expected = F.fast.make_step(tx)(grads, tx.init(params), params)
    with FlopCounterMode(display=False):
        got = F.fast.make_step(tx)(grads, tx.init(params), params)
    functopt.testing.assert_bitwise_equal(got, expected)


@pytest.mark.parametrize("kind", ["Optimizer", "optim.AdamW"])
def test_a_tensor_learning_rate_moved_in_place_reaches_the_replays(kind: str) -> None:
    """torch's idiom for schedules in a graph: a 0-d tensor ``lr`` in the param group,
    which the scheduler fills in place. The adapter's cast of it is recorded, so each
    replay reads its value."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt: torch.optim.Optimizer
    if kind == "Optimizer":
        opt = F.Optimizer(model.parameters(), F.adamw(1e-2, weight_decay=0.1))
        lr = opt.param_groups[0]["lr"] = torch.tensor(1e-2)  # (what a scheduler fills)
    else:
        lr = torch.tensor(1e-2)
        opt = F.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
        assert opt.param_groups[0]["lr"] is lr  # (kept as given, as torch.optim keeps it)
    for _ in range(2):
        model.zero_grad(set_to_none=False)
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
    tape = _capture._Tape()
    with tape:
        opt.step()
    lr.fill_(0.0)  # (lr 0: neither the update nor the decay moves a param)
    before = [p.detach().clone() for p in model.parameters()]
    key = "count" if kind == "Optimizer" else "step"  # (the drop-in shows torch's keys)
    count = int(opt.state[model.weight][key])
    tape.replay()
    functopt.testing.assert_bitwise_equal([p.detach() for p in model.parameters()], before)
    assert int(opt.state[model.weight][key]) == count + 1
    lr.fill_(1e-2)
    tape.replay()
    assert all(not torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before,
                                                              strict=True))
