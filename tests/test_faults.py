"""Fault injection (issue 12, item 5): killed saves, damaged files, overflow soaks, garbage
to every constructor, a rank that dies in the middle of a step.

References: POSIX ``rename`` atomicity for the saves, the zip format's CRC-32 for damage,
PyTorch's ``torch._amp_update_scale_`` kernel for the loss scale's trajectory.
"""

from __future__ import annotations

import datetime
import importlib
import inspect
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import functopt
from functopt import _serialization
from functopt._collective import stats as stats_module
from functopt.precision import dynamic_loss_scale, mixed_precision, static_loss_scale
from functopt.testing import bitwise_equal

ROOT = Path(__file__).resolve().parents[1]


def _state(seed: int) -> Any:
    torch.manual_seed(seed)
    params = {"w": torch.randn(256, 64), "b": torch.randn(64)}
    tx = functopt.adamw(1e-3)
    return tx.update(params, tx.init(params), params)[1]


# ---------------------------------------------------------------- a save killed half way

# The child saves a second state over the first and SIGKILLs itself at a hooked point:
# "write" after half the bytes reached the file, "rename" with the file complete but not
# yet renamed into place. "plain" is torch.save straight to the path, killed half way.
CHILD = textwrap.dedent("""
    import io, os, signal, sys, torch
    sys.path.insert(0, {tests!r})
    import functopt
    from test_faults import _state
    mode, path = sys.argv[1], sys.argv[2]
    real_save = torch.save

    def half_then_die(obj, f, *args, **kwargs):
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()
        f.write(data[: len(data) // 2])
        f.flush()
        os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    if mode == "write":
        torch.save = half_then_die
        functopt.save_checkpoint(_state(1), path)
    elif mode == "rename":
        os.replace = die
        functopt.save_checkpoint(_state(1), path)
    else:
        with open(path, "wb") as f:
            half_then_die(_state(1), f)
""")


def _kill_during_save(mode: str, path: Path) -> subprocess.CompletedProcess[str]:
    code = CHILD.format(tests=str(ROOT / "tests"))
    return subprocess.run([sys.executable, "-c", code, mode, str(path)], capture_output=True,
                          text=True, timeout=120, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("mode", ["write", "rename"])
def test_a_save_killed_half_way_leaves_the_previous_checkpoint_whole(mode, tmp_path) -> None:
    path = tmp_path / "opt.pt"
    before = _state(0)
    functopt.save_checkpoint(before, path)
    result = _kill_during_save(mode, path)
    assert result.returncode == -signal.SIGKILL, result.stderr  # it died at the hook
    assert bitwise_equal(functopt.load_checkpoint(path), before)  # the old file, whole
    strays = [p.name for p in tmp_path.iterdir() if p.name != "opt.pt"]
    assert len(strays) == 1 and strays[0].startswith(".opt.pt.") and strays[0].endswith(".tmp")
    functopt.save_checkpoint(_state(2), path)  # the next save is not disturbed by the stray
    assert bitwise_equal(functopt.load_checkpoint(path), _state(2))


def test_a_plain_torch_save_killed_half_way_is_refused_naming_the_file(tmp_path) -> None:
    path = tmp_path / "opt.pt"
    functopt.save_checkpoint(_state(0), path)
    result = _kill_during_save("plain", path)
    assert result.returncode == -signal.SIGKILL, result.stderr
    with pytest.raises(ValueError, match="truncated or damaged") as info:
        functopt.load_checkpoint(path)
    message = str(info.value)
    assert str(path) in message and f"({path.stat().st_size} bytes)" in message
    assert "functopt.save_checkpoint" in message  # the fix


def test_save_checkpoint_leaves_nothing_behind_when_the_object_cannot_be_saved(tmp_path
                                                                              ) -> None:
    path = tmp_path / "opt.pt"
    functopt.save_checkpoint(_state(0), path)
    with pytest.raises(Exception):  # noqa: B017 - whatever pickle raises for a lambda
        functopt.save_checkpoint({"f": lambda: 0}, path)
    assert [p.name for p in tmp_path.iterdir()] == ["opt.pt"]
    assert bitwise_equal(functopt.load_checkpoint(path), _state(0))
    mode = path.stat().st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask  # as open() would create it, not mkstemp's 0o600


DCP_CHILD = textwrap.dedent("""
    import os, signal, sys, torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    # Killed with the shards written, before the .metadata file that completes the save.
    FileSystemWriter.finish = lambda self, *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
    dcp.save({"opt": {"mu": torch.ones(3)}}, checkpoint_id=sys.argv[1])
""")


def test_a_killed_dcp_save_leaves_a_directory_without_metadata(tmp_path) -> None:
    """What docs/reliability.md tells DCP users: save to a new directory each time; an
    unfinished save is one without ``.metadata``, and loading it fails."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    path = tmp_path / "step-2"
    result = subprocess.run([sys.executable, "-c", DCP_CHILD, str(path)], capture_output=True,
                            text=True, timeout=120, check=False,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == -signal.SIGKILL, result.stderr
    names = sorted(p.name for p in path.iterdir())
    assert names and ".metadata" not in names  # shards, no completion marker
    target = {"opt": {"mu": torch.zeros(3)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it runs without a process group
        with pytest.raises(CheckpointException, match="metadata"):
            dcp.load(target, checkpoint_id=str(path))
    assert torch.equal(target["opt"]["mu"], torch.zeros(3))  # nothing half loaded


# ------------------------------------------------------------- truncated or damaged files

@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, Any]:
    path = tmp_path_factory.mktemp("ckpt") / "opt.pt"
    state = _state(0)
    functopt.save_checkpoint(state, path)
    return path.read_bytes(), state


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.floats(0.0, 1.0, exclude_max=True))
def test_a_truncated_file_is_refused_naming_it(saved, tmp_path, cut) -> None:
    data, _ = saved
    path = tmp_path / "cut.pt"
    path.write_bytes(data[: int(len(data) * cut)])
    with pytest.raises(ValueError, match="truncated or damaged") as info:
        functopt.load_checkpoint(path)
    assert repr(str(path)) in str(info.value)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.floats(0.0, 1.0, exclude_max=True), mask=st.integers(1, 255))
def test_a_damaged_byte_is_refused_or_changes_nothing(saved, tmp_path, where, mask) -> None:
    data, state = saved
    damaged = bytearray(data)
    damaged[int(len(data) * where)] ^= mask
    path = tmp_path / "bad.pt"
    path.write_bytes(bytes(damaged))
    try:
        loaded = functopt.load_checkpoint(path)
    except ValueError as error:
        assert "truncated or damaged" in str(error) and repr(str(path)) in str(error)
    else:  # a byte of padding or of a header field the reader ignores
        assert bitwise_equal(loaded, state)


def test_a_damaged_tensor_byte_loads_silently_without_verification(saved, tmp_path) -> None:
    data, state = saved
    damaged = bytearray(data)
    start = data.find(state[0].mu["w"].numpy().tobytes()[:64])
    assert start > 0
    damaged[start + 1001] ^= 0xFF  # a byte of mu["w"]'s data
    path = tmp_path / "bad.pt"
    path.write_bytes(bytes(damaged))
    loaded = functopt.load_checkpoint(path, verify=False)
    assert not bitwise_equal(loaded, state)  # why verify=True is the default
    with pytest.raises(ValueError, match=r"the CRC-32 of the record '.*' does not match"):
        functopt.load_checkpoint(path)


def test_a_missing_file_and_an_unknown_class_get_their_own_errors(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="no file at"):
        functopt.load_checkpoint(tmp_path / "absent.pt")
    path = tmp_path / "other.pt"
    torch.save({"when": datetime.date(2026, 12, 1)}, path)
    with pytest.raises(ValueError, match="does not allow") as info:
        functopt.load_checkpoint(path)
    assert "add_safe_globals" in str(info.value)
    assert _serialization.CHECKPOINT_UNSAFE.startswith("load_checkpoint: {path!r} holds")


# ------------------------------------------------------------ 1,000 steps of overflows

def _torch_scale(trace_of: list[bool], init: float, interval: int) -> list[float]:
    """The scale after each step by PyTorch's kernel (found_inf per step)."""
    scale = torch.tensor(init)
    tracker = torch.zeros((), dtype=torch.int32)
    out = []
    for overflow in trace_of:
        torch._amp_update_scale_(scale, tracker, torch.tensor(float(overflow)), 2.0, 0.5,
                                 interval)
        out.append(float(scale))
    return out


RULES = {
    "none": None,
    "static": static_loss_scale(128.0),
    "pytorch": dynamic_loss_scale(),
    "pytorch-growing": dynamic_loss_scale(init_scale=2.0**10, growth_interval=1),
    "megatron": dynamic_loss_scale(hysteresis=2, min_scale=1.0),
}


@pytest.mark.parametrize("name", list(RULES))
def test_soak_1000_steps_half_of_them_overflows_with_every_rule(name) -> None:
    rule = RULES[name]
    params = {"w": torch.randn(4, 3).bfloat16(), "b": torch.zeros(3, dtype=torch.float16)}
    step = mixed_precision(functopt.adamw(1e-3), loss_scale=rule, fused=False)
    state = step.init(params)
    gen = torch.Generator().manual_seed(0)
    overflows = [i % 2 == 0 for i in range(1000)]  # every other step overflows
    scales, skipped, taken = [], [], 0
    for i, overflow in enumerate(overflows):
        scale = 1.0 if rule is None else float(state.loss_scale.scale)
        # The gradients of a loss multiplied by the scale, as backward would give them.
        grads = {k: (torch.randn(v.shape, generator=gen) * 1e-3 * scale).to(v.dtype)
                 for k, v in params.items()}
        if overflow:
            grads["w" if i % 2 else "b"].view(-1)[i % 3] = math.nan if i % 3 else math.inf
        count = int(state.inner_state[0].count)  # adamw's own step counter
        params, state = step.step(grads, state, params)
        stepped = int(state.inner_state[0].count) == count + 1
        # A finite step is taken unless the scale has collapsed so far that its float32
        # inverse overflows (0.0 included): unscaling then gives inf or nan.
        inverse_finite = bool(torch.isfinite(1.0 / torch.tensor(scale, dtype=torch.float32)))
        assert stepped == (not overflow and inverse_finite), i
        taken += stepped
        skipped.append(not stepped)
        scales.append(float(state.loss_scale.scale))
        for leaf in functopt.tree.flatten(state._replace(metrics=None))[0]:
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
                assert bool(torch.isfinite(leaf).all()), f"step {i}"
    if name == "pytorch-growing":  # halved, then doubled by the next finite step
        assert scales == _torch_scale(skipped, 2.0**10, 1) and set(scales) == {2.0**9, 2.0**10}
    elif name == "pytorch":  # PyTorch's rule, collapse to 0.0 included
        assert scales == _torch_scale(skipped, 2.0**16, 2000) and scales[-1] == 0.0
    elif name in ("static", "none"):
        assert set(scales) == {128.0 if name == "static" else 1.0}
    else:  # megatron: halved every second overflow, floored at 1
        assert scales[-1] == 1.0 and min(scales) == 1.0
    # Once the scale collapsed (PyTorch's rule, no floor), finite steps are skipped too.
    if name == "pytorch":
        assert 100 <= taken < 200 and all(skipped[400:])
    else:
        assert taken == sum(not o for o in overflows)


# --------------------------------------------------- garbage to every public constructor

# The factories: every public callable that builds a transform, schedule, loss scale,
# master-weight strategy, step or optimizer (the functions that take a state or a tree to
# compute on are not constructors).
CONSTRUCTS = ("GradientTransformation", "Schedule", "LossScale", "MasterWeights",
              "MixedPrecisionTransformation", "Callable[..., GradientTransformation]",
              "StepFn", "Policy")
MODULES = ("functopt", "functopt.schedules", "functopt.contrib", "functopt.precision",
           "functopt.distributed", "functopt.fast", "functopt.optim", "functopt.adapters")


def _factories() -> dict[str, Any]:
    found: dict[str, Any] = {}
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj):
                if issubclass(obj, (torch.optim.Optimizer, functopt.MixedPrecisionOptimizer)):
                    found[f"{module_name}.{name}"] = obj
                continue
            if not inspect.isfunction(obj):
                continue  # an alias such as a type (Callable[...]) is not a factory
            returns = inspect.signature(obj).return_annotation
            if isinstance(returns, str) and returns in CONSTRUCTS:
                found[f"{module_name}.{name}"] = obj
    return found


FACTORIES = _factories()


# a required argument's value by its name, for the names that take something else than 0.1
_BY_NAME: dict[str, Callable[[], Any]] = {
    "params": lambda: [torch.nn.Parameter(torch.zeros(2))],
    "max_consecutive_errors": lambda: 10,
    "transition_begin": lambda: 10,
    "schedule": lambda: functopt.schedules.constant_schedule(1.0),
    "interpolate_type": lambda: "linear",
    "cosine_kwargs": lambda: [{"init_value": 1.0, "peak_value": 1.0, "decay_steps": 10}],
    **dict.fromkeys(("inner", "tx", "transform", "inner_opt", "transformation",
                     "base_optimizer"), lambda: functopt.sgd(0.1)),
    "transforms": lambda: {"a": functopt.sgd(0.1)},
    **dict.fromkeys(("labels", "param_labels"),
                    lambda: lambda params: {k: "a" for k in params}),
    "mask": lambda: lambda params: {k: True for k in params},
    "schedules": lambda: [functopt.schedules.constant_schedule(1.0)] * 2,
    "boundaries": lambda: [1],
    "boundaries_and_scales": lambda: {1: 0.5},
    **dict.fromkeys(("inner_factory", "factory"), lambda: functopt.sgd),
    **dict.fromkeys(("every_k_schedule", "every_k"), lambda: 2),
    "policy": lambda: "params=float32,compute=bfloat16,output=float32",
}


def _valid(name: str, param: inspect.Parameter) -> Any:
    """A value that makes the factory build, for a required argument."""
    n = param.name
    if name.endswith(("elementwise_rule", "per_leaf_rule")):  # a rule of the user's own
        from functopt._base import EmptyState

        return {"tx": functopt.scale(0.5), "name": "my_rule", "state": EmptyState}[n]
    if n in _BY_NAME:
        return _BY_NAME[n]()
    if n.endswith("steps"):
        return 10
    if n.endswith("_fn"):
        return functopt.schedules.constant_schedule(1.0)
    if n.endswith("_tx"):
        return functopt.sgd(0.1)
    return 0.1


def _base_call(name: str, factory: Any) -> dict[str, Any] | None:
    sig = inspect.signature(factory)
    kwargs = {p.name: _valid(name, p) for p in sig.parameters.values()
              if (p.default is inspect.Parameter.empty or p.name == "transform")
              and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            factory(**kwargs)
        except (TypeError, ValueError):
            return None
    return kwargs


BASES = {name: _base_call(name, f) for name, f in FACTORIES.items()}


def test_the_garbage_test_reaches_every_factory() -> None:
    assert len(FACTORIES) > 90  # recipes, transforms, schedules, contrib, precision, optim
    unreached = sorted(name for name, base in BASES.items() if base is None)
    # Each of these builds with arguments the generic filler cannot guess; they are
    # still given garbage, from a call that fails on its own with the same two types.
    assert len(unreached) <= 3, unreached


GARBAGE = st.one_of(
    st.none(), st.text(max_size=4), st.booleans(),
    st.sampled_from([-1, -1.5, 0, math.nan, math.inf, -math.inf, 1e300, -(2**70)]),
    st.builds(torch.ones, st.sampled_from([(3,), (2, 2), (0,)])),
    st.recursive(st.lists(st.integers(-3, 3), max_size=2),
                 lambda inner: st.lists(inner, max_size=2), max_leaves=4),
    st.just(object()), st.just(torch.float16), st.just({"a": [1, {"b": None}]}),
)


@settings(max_examples=1500, deadline=None)
@given(data=st.data())
def test_garbage_to_every_constructor_raises_only_value_or_type_errors(data) -> None:
    name = data.draw(st.sampled_from(sorted(FACTORIES)), label="factory")
    factory = FACTORIES[name]
    base = dict(BASES[name] or {})
    params = [p for p in inspect.signature(factory).parameters.values()
              if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not params:
        return
    target = data.draw(st.sampled_from(params), label="argument")
    value = data.draw(GARBAGE, label="value")
    if target.name == "differentiable" and value is True:
        return  # legal and refused as unsupported (NotImplementedError), as torch's would be
    base[target.name] = value
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            factory(**base)
        except (TypeError, ValueError):
            pass


@pytest.mark.parametrize(
    ("build", "owner", "got"),
    [(lambda: functopt.sgd(0.1, momentum=0.9, nesterov="yes"), "sgd", "str 'yes'"),
     (lambda: functopt.optim.Adam([torch.nn.Parameter(torch.zeros(2))], maximize=math.inf),
      "functopt.optim.Adam", "float inf"),
     (lambda: functopt.scale_by_adam(nesterov=torch.ones(3)), "scale_by_adam",
      "a tensor of shape (3,)")],
    ids=["recipe", "optim", "transform"])
def test_an_option_that_is_not_a_bool_names_the_factory_and_the_fix(build, owner, got) -> None:
    from functopt import _validate

    with pytest.raises(TypeError) as info:
        build()
    name = "maximize" if "optim" in owner else "nesterov"
    assert str(info.value) == _validate.FLAG_NOT_BOOL.format(owner=owner, name=name, got=got)
    assert f"Fix: pass {name}=True or {name}=False." in str(info.value)


# ------------------------------------------------------------ a rank that dies mid-step

def _dying_rank(rank: int, world: int, out_dir: str, stuck: bool) -> None:
    from distributed import harness

    from functopt.distributed import zero1

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=harness.store_in(out_dir), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=20))

    # A group of its own with a short timeout, so that a rank that hangs (alive, never
    # reaching the collective) is detected in seconds, not the harness's 20 s.
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=3))
    params = {"w": torch.ones(8)}
    opt = zero1(functopt.sgd(0.1), process_group=group, fused=False)
    state = opt.init(params)
    params, state = opt.step({"w": torch.ones(8)}, state, params)  # one step together
    dist.barrier(group)
    if rank == 1:
        if stuck:
            time.sleep(12)  # alive and silent past rank 0's timeout
        os._exit(17)  # dies in the middle of the second step
    start = time.monotonic()
    try:
        opt.step({"w": torch.ones(8)}, state, params)
        outcome = "returned"
    except RuntimeError as exc:
        notes = " ".join([*getattr(exc, "__notes__", []), str(exc)])  # notes: Python 3.11+
        outcome = f"{type(exc).__name__}|{str(exc)[:200].replace('|', '/')}|{notes}"
    with open(os.path.join(out_dir, "rank0.txt"), "w") as f:
        f.write(f"{time.monotonic() - start:.2f}|{outcome}")
    os._exit(0)  # the process group cannot be torn down cleanly with a dead peer


@pytest.mark.parametrize("stuck", [False, True], ids=["dies", "hangs"])
def test_a_rank_that_dies_mid_step_makes_the_other_fail_clearly(stuck, tmp_path) -> None:
    import multiprocessing

    # Not harness.run_ranks: it stops every rank as soon as one exits, and the point here
    # is what the surviving rank sees.
    ctx = multiprocessing.get_context("fork")
    ranks = [ctx.Process(target=_dying_rank, args=(r, 2, str(tmp_path), stuck))
             for r in range(2)]
    for proc in ranks:
        proc.start()
    try:
        for proc in ranks:
            proc.join(60)
    finally:
        for proc in ranks:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    assert [proc.exitcode for proc in ranks] == [0, 17]
    elapsed, kind, message, notes = (tmp_path / "rank0.txt").read_text().split("|", 3)
    assert kind != "returned"
    assert float(elapsed) < 15.0, message  # detected, not waited out
    assert "all_reduce of the gradient statistics" in notes and "over 2 ranks" in notes
    assert "restart every rank from the last checkpoint" in notes
    assert stats_module.COLLECTIVE_FAILED.startswith("functopt: the all_reduce")


# ------------------------------------------- a state dict taken while the state is offloaded

def test_a_state_dict_taken_while_offloaded_is_not_rewritten_by_a_later_offload() -> None:
    from functopt.adapters import MixedPrecisionOptimizer

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = MixedPrecisionOptimizer(model.named_parameters(), functopt.adam(0.1), fused=False)

    def step() -> None:
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        assert opt.step()

    step()
    opt.offload_to_cpu()
    saved = opt.state_dict()
    frozen = functopt.tree.map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, saved)
    opt.restore_from_cpu()
    step()  # the live state moves on
    opt.offload_to_cpu()  # once reused the host buffers the dict holds
    assert bitwise_equal(saved, frozen)
    assert not bitwise_equal(opt.state_dict(), frozen)  # the new offload holds the new state
