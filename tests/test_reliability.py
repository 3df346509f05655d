"""Misuse and faults: each case of docs/reliability.md gets the right result or a clear
error, and the dangerous but legal ones warn (issue 12).

References: PyTorch's own ``torch._amp_update_scale_`` kernel for the loss-scale rule,
float64 arithmetic in Python for norms.
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any

import pytest
import torch

import functopt
from functopt.adapters import MixedPrecisionOptimizer, _param_groups
from functopt.precision import (
    LossScaleWarning,
    dynamic_loss_scale,
    loss_scale_collapsed,
    mixed_precision,
    static_loss_scale,
)
from functopt.precision import loss_scale as loss_scale_module

TINY = torch.finfo(torch.float32).tiny


def _leaves(tree: Any) -> list[Any]:
    return [x for x in functopt.tree.flatten(tree)[0] if x is not None]


# ------------------------------------------------------------ a collapsing loss scale


def _torch_scale_trace(overflows: int) -> list[float]:
    """The scale after each overflow, by PyTorch's kernel (GradScaler's defaults)."""
    scale = torch.tensor(2.0**16)
    tracker = torch.zeros((), dtype=torch.int32)
    out = []
    for _ in range(overflows):
        torch._amp_update_scale_(scale, tracker, torch.tensor(1.0), 2.0, 0.5, 2000)
        out.append(float(scale))
    return out


def test_default_rule_reaches_zero_like_torch_and_collapse_is_detected() -> None:
    reference = _torch_scale_trace(200)
    ls = dynamic_loss_scale()
    state = ls.init()
    ours, flags = [], []
    for _ in range(200):
        state = ls.adjust(state, torch.tensor(True))
        ours.append(float(state.scale))
        flags.append(bool(loss_scale_collapsed(state)))
    assert ours == reference  # the documented rule is PyTorch's, collapse included
    first_zero = reference.index(0.0)
    assert 160 <= first_zero <= 170  # "about 165 overflows" in the docs
    assert flags == [s < TINY for s in reference]  # below 2**-126, not only at 0.0
    assert flags.index(True) < first_zero


def test_a_floor_never_collapses() -> None:
    ls = dynamic_loss_scale(min_scale=1.0, hysteresis=2)
    state = ls.init()
    for _ in range(1000):
        state = ls.adjust(state, torch.tensor(True))
    assert float(state.scale) == 1.0 and not bool(loss_scale_collapsed(state))


def _overflowing_facade(loss_scale: Any) -> tuple[MixedPrecisionOptimizer, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    opt = MixedPrecisionOptimizer(model.named_parameters(), functopt.adamw(1e-3),
                                  loss_scale=loss_scale)
    return opt, list(model.parameters())


def _overflow_step(opt: MixedPrecisionOptimizer, params: list[torch.Tensor]) -> bool:
    for p in params:
        p.grad = torch.full_like(p, math.inf)
    return opt.step()


def test_facade_warns_once_the_scale_collapses_pointing_at_the_callers_step() -> None:
    opt, params = _overflowing_facade(dynamic_loss_scale())
    before = [p.detach().clone() for p in params]
    collapse_at = [s < TINY for s in _torch_scale_trace(200)].index(True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(collapse_at):
            assert not _overflow_step(opt, params)
    assert caught == []  # a scale of 2**-126 and above: no warning
    with pytest.warns(LossScaleWarning, match=r"collapsed to .* every step is being skipped"
                      ) as record:
        assert not _overflow_step(opt, params)
    assert record[0].filename == __file__  # stacklevel: the caller's opt.step()
    for p, b in zip(params, before, strict=True):
        assert torch.equal(p, b)


@pytest.mark.parametrize(
    "rule", [dynamic_loss_scale(min_scale=1.0, hysteresis=2), static_loss_scale(2.0**10)],
    ids=["megatron", "static"])
def test_facade_with_a_floor_or_static_scale_never_warns(rule) -> None:
    opt, params = _overflowing_facade(rule)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(300):
            assert not _overflow_step(opt, params)
    assert opt.loss_scale == (1.0 if rule.dynamic else 2.0**10)


def test_collapse_message_is_a_named_constant_with_the_fix() -> None:
    text = loss_scale_module.LOSS_SCALE_COLLAPSED.format(scale=0.0, floor=TINY)
    assert "collapsed to 0.0" in text and "min_scale=1.0" in text and "inf or nan" in text


@pytest.mark.parametrize(
    ("rule", "final"),
    [(dynamic_loss_scale(), 0.0), (dynamic_loss_scale(hysteresis=2, min_scale=1.0), 1.0),
     (static_loss_scale(128.0), 128.0)],
    ids=["pytorch", "megatron", "static"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "pure"])
def test_overflow_soak_1000_steps_leaves_no_nan_and_the_documented_scale(rule, final, fused
                                                                           ) -> None:
    params = {"w": torch.randn(4, 3).bfloat16(), "b": torch.zeros(3, dtype=torch.float16)}
    step = mixed_precision(functopt.adamw(1e-3), loss_scale=rule, fused=fused)
    state = step.init(params)
    start = [x.clone() for x in _leaves(params)]
    gen = torch.Generator().manual_seed(0)
    current = params
    for i in range(1000):
        grads = {k: torch.randn(v.shape, generator=gen).to(v.dtype) for k, v in params.items()}
        grads["w" if i % 2 else "b"].view(-1)[i % 3] = math.nan if i % 3 else math.inf
        current, state = step.step(grads, state, current)
    for x, y in zip(_leaves(current), start, strict=True):
        assert torch.equal(x, y)  # every step skipped: params bitwise unchanged
    assert float(state.loss_scale.scale) == final
    for leaf in _leaves(state._replace(metrics=None)):
        if leaf.is_floating_point():
            assert bool(torch.isfinite(leaf).all())  # no nan or inf in any state leaf


# ------------------------------------------------------- a state from another transform

def _p() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(3), "b": torch.zeros(2)}


def _g() -> dict[str, torch.Tensor]:
    return {"w": torch.ones(3), "b": torch.ones(2)}


@pytest.mark.parametrize(
    ("tx", "other", "owner", "expected", "got"),
    [
        (functopt.lion(0.1), functopt.adamw(0.1), "scale_by_lion", "ScaleByLionState",
         "a ScaleByAdamState (fields count, mu, nu)"),  # same field names, once misread
        (functopt.adam(0.1), functopt.sgd(0.1), "scale_by_adam", "ScaleByAdamState",
         "an EmptyState"),  # once an AttributeError
        (functopt.sgd(0.1, momentum=0.9), functopt.adam(0.1), "trace", "TraceState",
         "a ScaleByAdamState"),
        (functopt.sgd(0.1), functopt.adam(0.1), "identity", "EmptyState", "a ScaleByAdamState"),
        (functopt.apply_if_finite(functopt.sgd(0.1), 2), functopt.sgd(0.1),
         "apply_if_finite", "ApplyIfFiniteState", "a tuple of 2"),
        (functopt.contrib.muon(0.1), functopt.adamw(0.1), "partition", "PartitionState",
         "a tuple of 3"),  # muon partitions matrices from the rest
    ],
    ids=["lion-adamw", "adam-sgd", "momentum-adam", "sgd-adam", "apply_if_finite", "muon"])
def test_a_state_from_another_transform_is_refused_by_its_type(tx, other, owner, expected, got
                                                                ) -> None:
    from functopt.transforms import _common

    foreign = other.init(_p())
    with pytest.raises(TypeError) as info:
        tx.update(_g(), foreign, _p())
    message = str(info.value)
    assert message.startswith(f"{owner}: state must be the {expected}")
    assert got in message and "Fix: pass the state returned by this transform's init" in message
    prefix = _common.STATE_TYPE_MISMATCH.split("{")[1]  # the named constant's text
    assert prefix.startswith("owner}")
    tx.update(_g(), tx.init(_p()), _p())  # its own state still works


def test_wrong_state_types_are_type_errors_and_wrong_structures_value_errors() -> None:
    tx = functopt.chain(functopt.scale(1.0), functopt.scale(2.0))
    with pytest.raises(TypeError, match="expects a tuple of 2 states, got a dict"):
        tx.update([torch.ones(1)], {})
    with pytest.raises(ValueError, match="got a tuple of length 3"):
        tx.update([torch.ones(1)], ((), (), ()))
    adam = functopt.adam(0.1)
    state = adam.init({"w": torch.zeros(3)})
    with pytest.raises(ValueError, match="structure"):
        adam.update(_g(), state, _p())  # the right type, another tree: ValueError


# ---------------------------------------------- grads that do not match the params given

@pytest.mark.parametrize("make", [lambda: functopt.sgd(0.1), lambda: functopt.sgd(
    functopt.schedules.constant_schedule(0.1)), lambda: functopt.sign_sgd(0.1)],
    ids=["sgd", "sgd-schedule", "sign_sgd"])
def test_stateless_recipe_refuses_grads_with_an_extra_leaf(make) -> None:
    tx = make()
    params = _p()
    state = tx.init(params)
    grads = dict(_g(), extra=torch.ones(1))
    with pytest.raises(ValueError, match=r"params does not have the structure of updates .*"
                                         r"'extra'"):
        tx.update(grads, state, params)
    missing = {"w": torch.ones(3)}
    with pytest.raises(ValueError, match=r"params does not have the structure of updates"):
        tx.update(missing, state, params)
    tx.update(_g(), state, params)  # matching trees still pass
    tx.update(grads, state)  # no params given: nothing to compare


# --------------------------------------------------------- what a schedule may return

@pytest.mark.parametrize(
    ("value", "got"),
    [(lambda c: torch.full((3,), 0.1), r"a torch.float32 tensor of shape \(3,\)"),
     (lambda c: "0.1", r"str '0.1'"),
     (lambda c: torch.tensor(True), r"a torch.bool tensor of shape \(\)"),
     (lambda c: None, r"NoneType None")],
    ids=["shape-3", "str", "bool", "none"])
@pytest.mark.parametrize(
    ("make", "owner"),
    [(lambda s: functopt.sgd(s), "scale_by_learning_rate"),
     (lambda s: functopt.adamw(0.1, weight_decay=s), "add_decayed_weights"),
     (lambda s: functopt.scale_by_schedule(s), "scale_by_schedule")],
    ids=["learning_rate", "weight_decay", "scale_by_schedule"])
def test_a_schedule_returning_no_scalar_is_named(value, got, make, owner) -> None:
    tx = make(value)
    params = _p()
    with pytest.raises(TypeError, match=rf"^{owner}: the schedule passed as \w+ \(.*<lambda>\) "
                                        rf"returned {got}; expected a Python number"):
        tx.update(_g(), tx.init(params), params)


def test_a_schedule_that_goes_bad_later_is_named_under_inject_hyperparams() -> None:
    tx = functopt.inject_hyperparams(functopt.adam)(
        learning_rate=lambda c: torch.where(c < 1, 0.1, 0.2) if True else None)
    params = _p()
    state = tx.init(params)
    tx.update(_g(), state, params)  # a 0-d tensor: fine
    bad = functopt.inject_hyperparams(functopt.adam)(
        learning_rate=lambda c: 0.1 if int(c) < 1 else torch.ones(3))
    state = bad.init(params)
    _, state = bad.update(_g(), state, params)
    with pytest.raises(TypeError, match=r"inject_hyperparams\(adam\): the schedule passed as "
                                        r"'learning_rate' .* shape \(3,\)"):
        bad.update(_g(), state, params)


# ------------------------------------------------- torch.load(weights_only=True) of states

def _every_state(params: dict[str, torch.Tensor]) -> dict[str, Any]:
    tx = functopt.chain(
        functopt.masked(functopt.clip_by_global_norm(1.0), {"w": True, "b": False}),
        functopt.inject_hyperparams(functopt.adamw)(learning_rate=1e-3),
        functopt.apply_if_finite(functopt.lion(1e-4), 3))
    low = {k: v.bfloat16() for k, v in params.items()}
    return {
        "chain": tx.init(params),
        "multi": functopt.MultiSteps(functopt.adam(0.1), 2).init(params),
        "partition": functopt.partition({"a": functopt.sgd(0.1, momentum=0.9),
                                         "b": functopt.adafactor(0.1)},
                                        {"w": "a", "b": "b"}).init(params),
        "mixed": mixed_precision(functopt.adamw(0.1), loss_scale=dynamic_loss_scale()).init(low),
        "contrib": (functopt.contrib.muon(0.1).init(params),
                    functopt.contrib.schedule_free_adamw(0.1).init(params)),
    }


def test_every_state_loads_with_the_default_torch_load_after_import() -> None:
    import io
    import pickle

    state = _every_state(_p())
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)  # PyTorch's default, weights_only=True
    assert functopt.tree.structure(loaded) == functopt.tree.structure(state)
    for a, b in zip(functopt.tree.flatten(loaded)[0], functopt.tree.flatten(state)[0],
                    strict=True):
        assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b))
    # the import allows the state classes, nothing else: weights_only keeps refusing code
    buffer = io.BytesIO()
    torch.save({"state": state, "fn": functopt.adamw}, buffer)
    buffer.seek(0)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        torch.load(buffer)


def test_the_import_itself_allows_the_state_classes(tmp_path) -> None:
    # In a new interpreter: a state saved there loads with the default torch.load once
    # functopt is imported, and not before.
    import subprocess
    import sys

    path = tmp_path / "state.pt"
    code = (
        "import pickle, sys, torch\n"
        "from functopt import adamw\n"
        "import functopt\n"
        "torch.save(adamw(1e-3).init({'w': torch.ones(2)}), sys.argv[1])\n"
    )
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, timeout=120)
    check = (
        "import pickle, sys, torch\n"
        "try:\n"
        "    torch.load(sys.argv[1])\n"
        "    print('loaded before import')\n"
        "except pickle.UnpicklingError:\n"
        "    print('refused before import')\n"
        "import functopt\n"
        "state = torch.load(sys.argv[1])\n"
        "print(type(state[0]).__name__, bool(state[0].mu['w'].eq(0).all()))\n"
    )
    out = subprocess.run([sys.executable, "-c", check, str(path)], check=True, timeout=120,
                         capture_output=True, text=True).stdout.split("\n")
    assert out[:2] == ["refused before import", "ScaleByAdamState True"]


def test_a_safe_globals_block_leaves_the_import_s_allowance_in_place() -> None:
    # torch's safe_globals block removes its classes on leaving it, allowed before or not
    import io

    from functopt.testing import conformance

    state = functopt.adamw(1e-3).init({"w": torch.ones(2)})
    with functopt.safe_globals():
        pass
    conformance.check_state_roundtrip(functopt.adamw(1e-3), {"w": torch.ones(2)},
                                      {"w": torch.ones(2)})
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    assert type(torch.load(buffer)[0]) is functopt.ScaleByAdamState


def test_safe_globals_allows_the_state_classes_after_they_were_cleared() -> None:
    import io
    import pickle

    state = _every_state(_p())
    buffer = io.BytesIO()
    torch.save(state, buffer)
    allowed = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        buffer.seek(0)
        with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
            torch.load(buffer)
        buffer.seek(0)
        with functopt.safe_globals():
            loaded = torch.load(buffer)
        assert functopt.tree.structure(loaded) == functopt.tree.structure(state)
    finally:
        torch.serialization.add_safe_globals(allowed)


def test_state_classes_cover_every_namedtuple_the_package_defines() -> None:
    import ast
    from pathlib import Path

    package = Path(functopt.__file__).parent
    defined = set()
    for path in package.rglob("*.py"):
        if "testing" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    getattr(base, "id", None) == "NamedTuple" for base in node.bases):
                defined.add(node.name)
    listed = {cls.__name__ for cls in functopt.state_classes()}
    assert {name for name in defined if name.endswith("State")} <= listed
    assert len(defined - listed) == 0, defined - listed


# ------------------------------------------------------------- pickling functopt.Optimizer

@pytest.mark.filterwarnings("ignore::functopt.fast.FastPathWarning")
@pytest.mark.parametrize("name", list(_param_groups.RECIPE_GROUP_KEYS))
def test_a_functopt_optimizer_over_a_recipe_pickles_and_goes_on_as_the_original(
        name: str) -> None:
    import pickle

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = functopt.Optimizer(model.parameters(), getattr(functopt, name)(1e-2))
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(1, 3)).square().sum().backward()
        opt.step()
    twin_model, twin = pickle.loads(pickle.dumps((model, opt)))
    assert twin.param_groups[0].keys() == opt.param_groups[0].keys()
    for m, o in ((model, opt), (twin_model, twin)):
        for _ in range(2):
            o.zero_grad()
            m(torch.ones(1, 3)).square().sum().backward()
            o.step()
    for p, q in zip(model.parameters(), twin_model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_pickling_a_functopt_optimizer_says_why_and_what_to_do_deepcopy_works() -> None:
    import copy
    import pickle

    from functopt.adapters import optimizer as optimizer_module

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = functopt.Optimizer(model.parameters(), functopt.chain(  # no recipe: closures only
        functopt.scale_by_adam(), functopt.scale(-1e-2)))
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    with pytest.raises(TypeError) as info:
        pickle.dumps(opt)
    message = str(info.value)
    assert message.startswith("functopt.Optimizer cannot be pickled")
    assert "Can't pickle local object" in message and "state_dict()" in message
    assert optimizer_module.OPTIMIZER_NOT_PICKLABLE.split("{")[0] in message
    # a recipe given a schedule as a lambda: its call cannot be stored either
    scheduled = functopt.Optimizer(model.parameters(), functopt.adamw(lambda c: 1e-2))
    with pytest.raises(TypeError, match=r"functopt\.Optimizer cannot be pickled"):
        pickle.dumps(scheduled)
    twin = copy.deepcopy(opt)  # an in-process copy still works, and steps alike
    twin_params = list(twin.param_groups[0]["params"])
    assert all(p is not q for p, q in zip(twin_params, model.parameters(), strict=True))
    for p in twin_params:
        p.grad = torch.ones_like(p)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    twin.step()
    for p, q in zip(twin_params, model.parameters(), strict=True):
        assert torch.equal(p, q)


# ------------------------------------------- a facade checkpoint under another loss-scale rule

def _facade(rule: Any) -> MixedPrecisionOptimizer:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    return MixedPrecisionOptimizer(model.named_parameters(), functopt.sgd(0.1), loss_scale=rule)


@pytest.mark.parametrize(
    ("saved", "loaded", "words"),
    [(dynamic_loss_scale(), None, "saved with dynamic_loss_scale(init_scale=65536.0"),
     (None, dynamic_loss_scale(), "saved with no loss scale (loss_scale=None)"),
     (dynamic_loss_scale(), dynamic_loss_scale(hysteresis=2, min_scale=1.0), "hysteresis=1"),
     (static_loss_scale(128.0), static_loss_scale(256.0), "static_loss_scale(init_scale=128.0)"),
     (static_loss_scale(128.0), dynamic_loss_scale(), "this optimizer has dynamic_loss_scale")],
    ids=["fp16-to-bf16", "none-to-dynamic", "pytorch-to-megatron", "static-128-256",
         "static-to-dynamic"])
def test_facade_refuses_a_checkpoint_of_another_loss_scale_rule(saved, loaded, words) -> None:
    from functopt.adapters import mixed_precision_optimizer as facade_module

    state_dict = _facade(saved).state_dict()
    target = _facade(loaded)
    before = [p.detach().clone() for p in target._params]
    with pytest.raises(ValueError, match=r"^MixedPrecisionOptimizer.load_state_dict: the "
                                         r"checkpoint was saved with ") as info:
        target.load_state_dict(state_dict)
    assert words in str(info.value)
    assert facade_module.LOSS_SCALE_RULE_MISMATCH.split("{")[0] in str(info.value)
    for p, b in zip(target._params, before, strict=True):
        assert torch.equal(p, b)  # nothing loaded


def test_facade_checkpoint_loads_under_the_same_rule_and_a_deliberate_switch_works() -> None:
    source = _facade(dynamic_loss_scale())
    for p in source._params:
        p.grad = torch.ones_like(p)
    assert source.step()
    state_dict = source.state_dict()
    same = _facade(dynamic_loss_scale(init_scale=8.0))  # the initial scale is not the rule
    same.load_state_dict(state_dict)
    assert same.loss_scale == 2.0**16
    for p, q in zip(same._params, source._params, strict=True):
        assert torch.equal(p, q)
    # Switching rules on purpose (the fix the message gives): this optimizer's own entries.
    bf16 = _facade(None)
    own = bf16.state_dict()
    switched = copy.deepcopy(state_dict)
    for pid, entry in switched["state"].items():
        entry.update({k: v for k, v in own["state"][pid].items() if k.startswith("loss_scale.")})
    for group, ours in zip(switched["param_groups"], own["param_groups"], strict=True):
        group["functopt"]["loss_scale_rule"] = ours["functopt"]["loss_scale_rule"]
    bf16.load_state_dict(switched)
    assert bf16.loss_scale == 1.0
    for p in bf16._params:
        p.grad = torch.ones_like(p)
    before = [p.detach().float().clone() for p in bf16._params]
    assert bf16.step()
    for p, b in zip(bf16._params, before, strict=True):
        # An SGD step of lr * grad = 0.1, not 0.1 * 65536.
        torch.testing.assert_close(p.float(), b - 0.1, rtol=0, atol=2e-2)
    unrecorded = copy.deepcopy(state_dict)
    for group in unrecorded["param_groups"]:
        del group["functopt"]["loss_scale_rule"]
    _facade(dynamic_loss_scale()).load_state_dict(unrecorded)  # no record: unchecked


# --- functopt.Optimizer given torch.optim's things; sparse gradients ---------------------


def test_optimizer_given_a_torch_optimizer_or_torch_kwargs_says_what_to_do() -> None:
    from functopt.adapters.optimizer import NO_TRANSFORM, TORCH_OPTIMIZER

    ps = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(TypeError) as caught:
        functopt.Optimizer(ps, torch.optim.AdamW)  # type: ignore[arg-type]
    assert str(caught.value) == TORCH_OPTIMIZER.format(name="AdamW")
    assert "functopt.optim.AdamW(params" in str(caught.value)
    with pytest.raises(TypeError, match=r"the transform is torch\.optim's SGD"):
        functopt.Optimizer(ps, torch.optim.SGD(ps, lr=0.1))  # type: ignore[arg-type]
    with pytest.raises(TypeError) as caught:
        functopt.Optimizer(ps, lr=1e-3)
    assert str(caught.value) == NO_TRANSFORM.format(given="lr=0.001")
    with pytest.raises(TypeError, match="got no transform"):
        functopt.Optimizer(ps)


@pytest.mark.parametrize("path", ["pure", "make_step", "mixed"])
def test_sparse_gradients_are_refused_naming_the_leaf(path: str) -> None:
    """The pure path treated a sparse gradient as dense and the fast path failed inside
    PyTorch; both refuse it now, with the leaf and the fix."""
    tx = functopt.adamw(1e-3)
    params = {"emb": torch.zeros(4, 3), "b": torch.zeros(3)}
    grads = {"emb": torch.zeros(4, 3).to_sparse(), "b": torch.ones(3)}
    with pytest.raises(TypeError, match=r"leaf 'emb' is a torch.sparse_coo tensor.*to_dense"):
        if path == "pure":
            tx.update(grads, tx.init(params), params)
        elif path == "make_step":
            functopt.fast.make_step(tx)(grads, tx.init(params), params)
        else:
            mp = functopt.precision.mixed_precision(tx)
            mp.step(grads, mp.init(params), params)


@pytest.mark.parametrize(("make", "owner", "expected"), [
    (lambda: functopt.scale_by_adamax(), "scale_by_adamax", "ScaleByAdamState"),
    (lambda: functopt.scale_by_radam(), "scale_by_radam", "ScaleByAdamState"),
    (lambda: functopt.scale_by_nadam(), "scale_by_nadam", "ScaleByNadamState"),
    (lambda: functopt.scale_by_adadelta(), "scale_by_adadelta", "ScaleByAdaDeltaState"),
    (lambda: functopt.scale_by_rprop(0.1), "scale_by_rprop", "ScaleByRpropState"),
    (lambda: functopt.dampened_trace(0.9, dampening=0.1), "dampened_trace",
     "DampenedTraceState"),
], ids=["adamax", "radam", "nadam", "adadelta", "rprop", "dampened_trace"])
def test_the_torch_rule_transforms_refuse_a_state_by_its_type(make, owner, expected) -> None:
    """The transforms functopt.optim added check their state's type as every built-in
    does (an sgd state used to reach them as an AttributeError or a misread field)."""
    tx = make()
    with pytest.raises(TypeError) as info:
        tx.update(_g(), functopt.sgd(0.1).init(_p()), _p())
    assert str(info.value).startswith(f"{owner}: state must be the {expected}")
    tx.update(_g(), tx.init(_p()), _p())


# ------------------------------------------------ a state on another device than the params

@pytest.mark.parametrize(
    ("tx", "field"),
    [(functopt.adam(0.1), "state.mu"), (functopt.sgd(0.1, momentum=0.9), "state.trace"),
     (functopt.rmsprop(0.1), "state.nu"), (functopt.lion(0.1), "state.mu"),
     (functopt.adafactor(0.1), "state.v_row"), (functopt.contrib.prodigy(), "state.exp_avg")],
    ids=["adam", "momentum", "rmsprop", "lion", "adafactor", "prodigy"])
def test_a_state_on_another_device_is_refused_naming_the_leaf(tx, field) -> None:
    from functopt.transforms import _common

    params = {"w": torch.zeros(4, 3), "b": torch.zeros(3)}
    state = tx.init(params)
    # "meta" stands for another device on a CPU-only machine: same check, no accelerator.
    moved = functopt.tree.map(
        lambda x: x.to("meta") if isinstance(x, torch.Tensor) and x.dim() > 0 else x, state)
    with pytest.raises(ValueError) as info:
        tx.update(_g4(), moved, params)
    message = str(info.value)
    assert message.startswith(f"{field} leaf ") and "is on meta but its update is on cpu" in message
    assert "x.to('cpu')" in message  # the fix, with the device to move to
    assert _common.STATE_DEVICE.startswith("{name} leaf {path!r} is on {got}")
    tx.update(_g4(), state, params)  # on the params' device it still works


@pytest.mark.parametrize("compile", [False, True], ids=["kernels", "compiled"])
def test_a_state_on_another_device_is_refused_naming_the_leaf_on_the_fast_path(compile) -> None:
    """make_step: the planner refuses the group (a state entry on another device than its
    param), so the step takes the pure path, which names the leaf, instead of failing
    inside a PyTorch kernel."""
    tx = functopt.adamw(0.1) if not compile else functopt.lion(0.1)
    params = {"w": torch.zeros(4, 3), "b": torch.zeros(3)}
    moved = functopt.tree.map(
        lambda x: x.to("meta") if isinstance(x, torch.Tensor) and x.dim() > 0 else x,
        tx.init(params))
    explained = functopt.fast.explain(tx, params, moved, compile=compile)
    assert not explained.fast and "is on meta, the param on cpu" in str(explained.reason)
    with torch.no_grad(), pytest.warns(functopt.fast.FastPathWarning), pytest.raises(
            ValueError, match=r"state\.mu leaf '(b|w)' is on meta but its update is on cpu"):
        functopt.fast.make_step(tx, compile=compile)(_g4(), moved, params)


def _g4() -> dict[str, torch.Tensor]:
    return {"w": torch.ones(4, 3), "b": torch.ones(3)}


# --------------------------------------------- a checkpoint dict built with another model

def test_state_to_dict_refuses_the_params_of_an_unrelated_model() -> None:
    from functopt.distributed import state_to_dict

    params = {"w": torch.zeros(4, 3), "b": torch.zeros(3)}
    state = functopt.adam(0.1).init(params)
    with pytest.raises(ValueError, match=r"none of the state's per-param entries "
                                         r"\(\['0.mu.b', '0.mu.w', '0.nu.b', '0.nu.w'\]\) "
                                         r"belongs to the params given \(\['x'\]\)"):
        state_to_dict(state, {"x": torch.zeros(4, 3)})
    assert sorted(state_to_dict(state, params)) == ["0.count", "0.mu.b", "0.mu.w", "0.nu.b",
                                                    "0.nu.w", "@integrity"]
    # Only 0-d entries under dict keys (a partition of stateless transforms, keyed by its
    # labels): nothing per-param to check, so any params are accepted.
    tx = functopt.partition({"a": functopt.sgd(0.1), "b": functopt.sgd(0.2)},
                            lambda p: {"w": "a", "b": "b"})
    out = state_to_dict(tx.init(params), {"x": torch.zeros(1)})
    assert all(v.dim() == 0 for k, v in out.items() if k != "@integrity")
    with pytest.raises(ValueError, match="initialised on another model"):
        state_to_dict(functopt.adam(0.1).init({"q": torch.zeros(2)}), params)
