"""The one state format of both adapters, and torch.distributed.checkpoint's helpers on it.

``functopt.Optimizer`` and ``MixedPrecisionOptimizer`` save through one codec
(``functopt/adapters/_state_dict.py``): torch's layout from ``state_dict()`` (int ids, each
entry keyed by state paths, the configuration in each group's ``"functopt"`` record), the
same keyed by names from ``named_state_dict()``. The references here are the optimizers
themselves run without a checkpoint: a save and load in the middle of training must leave
the run bitwise the one without it.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import functopt
from functopt import MixedPrecisionOptimizer
from functopt.adapters import _state_dict
from functopt.precision.loss_scale import _rule_vector

dcp = pytest.importorskip("torch.distributed.checkpoint")
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2),
                               torch.nn.Linear(2, 1)).to(torch.bfloat16)


def _facade(net: torch.nn.Module, **kw) -> MixedPrecisionOptimizer:  # type: ignore[no-untyped-def]
    # three groups: weight decay, none (lr_mult 2) and a frozen one, through a factory
    groups = [{"params": [(n, p) for n, p in net.named_parameters()
                          if n.startswith("0.")]},
              {"params": [("2.weight", net[2].weight), ("2.bias", net[2].bias)],
               "weight_decay": 0.0, "lr_mult": 2.0},
              {"params": net[3].named_parameters(prefix="3"), "frozen": True}]
    kw.setdefault("loss_scale", functopt.dynamic_loss_scale(init_scale=2.0**10,
                                                            growth_interval=2))
    return MixedPrecisionOptimizer(
        groups, lambda learning_rate=1e-2, weight_decay=0.1: functopt.adamw(
            learning_rate, weight_decay=weight_decay), **kw)


def _train(net: torch.nn.Module, opt: MixedPrecisionOptimizer, steps: range) -> list[bool]:
    took = []
    for t in steps:
        x = torch.linspace(-1, 1, 15).reshape(5, 3).to(torch.bfloat16) * (t + 1)
        opt.backward(net(x).float().pow(2).mean() * (math.inf if t == 2 else 1.0))
        took.append(opt.step())
        opt.zero_grad()
    return took


def _bits(net: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().view(torch.int16).clone() for p in net.parameters()]


def _same_state(a: MixedPrecisionOptimizer, b: MixedPrecisionOptimizer) -> bool:
    fa = _state_dict.to_nested("a", a._state)
    fb = _state_dict.to_nested("b", b._state)

    def same(x, y):  # type: ignore[no-untyped-def]
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
        return x.dtype == y.dtype and x.shape == y.shape and torch.equal(
            x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))  # NaN too

    return bool(same(fa, fb))


def test_dcp_helpers_save_and_load_the_facade_bitwise(tmp_path) -> None:
    net = _net(0)
    opt = _facade(net)
    assert _train(net, opt, range(4)) == [True, True, False, True]  # one overflow skip
    weights = _bits(net)
    osd = get_optimizer_state_dict(net, opt)
    assert all(torch.equal(a, b) for a, b in zip(_bits(net), weights, strict=True))  # no step
    assert set(osd["state"]) == {n for n, _ in net.named_parameters()}
    entry = osd["state"]["0.weight"]
    assert entry["master"] is opt._state.master["0.weight"]
    assert entry["loss_scale.scale"].item() == opt.loss_scale
    assert osd["state"]["3.weight"] == {}  # frozen: no state
    dcp.save({"model": net.state_dict(), "optim": osd}, checkpoint_id=tmp_path)

    other = _net(5)
    other_opt = _facade(other)
    assert not _same_state(opt, other_opt)
    held = {"model": other.state_dict(), "optim": get_optimizer_state_dict(other, other_opt)}
    dcp.load(held, checkpoint_id=tmp_path)
    other.load_state_dict(held["model"])
    set_optimizer_state_dict(other, other_opt, held["optim"])
    assert _same_state(opt, other_opt)  # masters, moments, loss scale and counters
    assert other_opt.loss_scale == opt.loss_scale
    assert other_opt._state.metrics.skipped_steps.item() == 1
    assert _train(net, opt, range(4, 8)) == _train(other, other_opt, range(4, 8))
    assert all(torch.equal(a, b) for a, b in zip(_bits(net), _bits(other), strict=True))
    assert _same_state(opt, other_opt)


def test_dcp_helpers_take_no_step_on_a_fresh_facade() -> None:
    """DCP steps with zero gradients when ``optimizer.state`` is empty; the facade's is a
    view of the state it builds at construction, so nothing moves (a weight decay would)."""
    net = _net(0)
    opt = _facade(net)
    weights = _bits(net)
    before = copy.deepcopy(_state_dict.to_nested("s", opt._state))
    assert len(opt.state) == 6 and all(opt.state[p] for p in net[0].parameters())
    set_optimizer_state_dict(net, opt, get_optimizer_state_dict(net, opt))
    assert all(torch.equal(a, b) for a, b in zip(_bits(net), weights, strict=True))
    after = _state_dict.to_nested("s", opt._state)
    assert after["inner_state"]["inner_states"]["0"]["0"]["count"].item() == 0
    assert str(after) == str(before)


def test_named_state_dict_is_the_dcp_layout_and_loads_by_name() -> None:
    net = _net(0)
    opt = _facade(net)
    _train(net, opt, range(3))
    named = opt.named_state_dict()
    osd = get_optimizer_state_dict(net, opt)
    assert named["state"].keys() == osd["state"].keys()
    for name, entry in named["state"].items():
        assert entry.keys() == osd["state"][name].keys()
        assert all(v is osd["state"][name][k] for k, v in entry.items())
    # A twin whose groups list their params in another order loads each by its name.
    twin = _net(0)
    groups = [{"params": [("0.bias", twin[0].bias), ("0.weight", twin[0].weight)]},
              {"params": [("2.bias", twin[2].bias), ("2.weight", twin[2].weight)],
               "weight_decay": 0.0, "lr_mult": 2.0},
              {"params": twin[3].named_parameters(prefix="3"), "frozen": True}]
    twin_opt = MixedPrecisionOptimizer(
        groups, lambda learning_rate=1e-2, weight_decay=0.1: functopt.adamw(
            learning_rate, weight_decay=weight_decay),
        loss_scale=functopt.dynamic_loss_scale(init_scale=2.0**10, growth_interval=2))
    twin_opt.load_named_state_dict(copy.deepcopy(named))
    assert _same_state(opt, twin_opt)
    assert _train(net, opt, range(3, 6)) == _train(twin, twin_opt, range(3, 6))
    assert all(torch.equal(a, b) for a, b in zip(_bits(net), _bits(twin), strict=True))


@pytest.mark.parametrize(
    ("change", "words"),
    [({"master_dtype": torch.float64}, r"saved with master_dtype 'float32', this optimizer "
                                       r"has 'float64'"),
     ({"loss_scale": None}, r"checkpoint was saved with dynamic_loss_scale"),
     ({"transform": "adam"}, r"saved with transform 'adamw\(.*this optimizer has 'adam\(")],
    ids=["master-dtype", "loss-scale-rule", "recipe"])
def test_a_configuration_that_does_not_match_raises_naming_it(change, words) -> None:
    net = _net(0)
    opt = _facade(net)
    _train(net, opt, range(2))
    saved = opt.state_dict()
    target_net = _net(3)
    if change.get("transform") == "adam":
        target = MixedPrecisionOptimizer(target_net.named_parameters(), functopt.adam(1e-2))
        saved = MixedPrecisionOptimizer(net.named_parameters(),
                                        functopt.adamw(1e-2)).state_dict()
    else:
        target = _facade(target_net, **change)
    weights = _bits(target_net)
    with pytest.raises(ValueError, match=words):
        target.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(_bits(target_net), weights, strict=True))


def test_other_param_names_raise_naming_them() -> None:
    a = {"w": torch.nn.Parameter(torch.ones(2)), "v": torch.nn.Parameter(torch.ones(3))}
    b = {"w": torch.nn.Parameter(torch.ones(2)), "u": torch.nn.Parameter(torch.ones(3))}
    saved = MixedPrecisionOptimizer(a, functopt.adam(0.1)).state_dict()
    with pytest.raises(ValueError, match=r"this group's \['u'\] have no saved state and the "
                                         r"saved \['v'\] no param here"):
        MixedPrecisionOptimizer(b, functopt.adam(0.1)).load_state_dict(saved)
    named = MixedPrecisionOptimizer(a, functopt.adam(0.1)).named_state_dict()
    with pytest.raises(ValueError, match=r"this group's \['u'\] have no saved state"):
        MixedPrecisionOptimizer(b, functopt.adam(0.1)).load_named_state_dict(named)


def test_a_checkpoint_of_the_nested_format_of_before_still_loads() -> None:
    """main's facade saved ``to_nested(state)`` plus the rule vector and the group values:
    such a checkpoint loads, and training continues bitwise."""
    net = _net(0)
    opt = _facade(net)
    _train(net, opt, range(4))
    old = _state_dict.to_nested("old", opt._state)
    old["loss_scale_rule"] = _rule_vector(opt._loss_scale_rule)
    old["param_groups"] = [{k: v for k, v in g.items() if k not in ("params", "param_names")}
                           for g in opt.param_groups]
    old = copy.deepcopy(old)
    twin = _net(0)
    twin_opt = _facade(twin)
    twin_opt.load_state_dict(old)
    assert _same_state(opt, twin_opt)
    assert _train(net, opt, range(4, 7)) == _train(twin, twin_opt, range(4, 7))
    assert all(torch.equal(a, b) for a, b in zip(_bits(net), _bits(twin), strict=True))
    old["loss_scale_rule"] = _rule_vector(None)
    with pytest.raises(ValueError, match="checkpoint was saved with no loss scale"):
        _facade(_net(0)).load_state_dict(old)


def test_a_later_format_and_a_shared_leaf_that_differs_raise() -> None:
    opt = MixedPrecisionOptimizer({"w": torch.nn.Parameter(torch.ones(2)),
                                   "v": torch.nn.Parameter(torch.ones(3))}, functopt.adam(0.1))
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0]["functopt"]["format"] = _state_dict.FORMAT + 1
    with pytest.raises(ValueError, match=rf"functopt's state format {_state_dict.FORMAT + 1}, "
                                         rf"this version reads up to {_state_dict.FORMAT}"):
        opt.load_state_dict(saved)
    saved["param_groups"][0]["functopt"]["format"] = _state_dict.FORMAT
    saved["state"][1]["loss_scale.scale"] = torch.tensor(2.0)
    with pytest.raises(ValueError, match=r"'loss_scale.scale' is one value for all params, but "
                                         r"the entries of params 'w' and 'v' differ"):
        opt.load_state_dict(saved)
    with pytest.raises(TypeError, match=r"optimizer.state is a view"):
        opt.state = {torch.ones(1): {}}


def test_the_torch_view_round_trips_through_torch_load_weights_only(tmp_path) -> None:
    for opt in (_facade(_net(0)),
                functopt.Optimizer(_net(0).named_parameters(), functopt.adamw(1e-2))):
        path = tmp_path / "opt.pt"
        torch.save(opt.state_dict(), path)
        loaded = torch.load(path, weights_only=True)
        assert loaded["param_groups"][0]["functopt"]["format"] == _state_dict.FORMAT
        opt.load_state_dict(loaded)


def test_dcp_helpers_on_functopt_optimizer_with_a_frozen_group(tmp_path) -> None:
    """DCP's strict load wants an entry for every param that requires grad: a frozen
    group's params have empty ones."""
    def build(seed):  # type: ignore[no-untyped-def]
        torch.manual_seed(seed)
        net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
        opt = functopt.Optimizer([{"params": list(net[0].named_parameters(prefix="0")),
                                   "frozen": True},
                                  {"params": list(net[1].named_parameters(prefix="1"))}],
                                 functopt.adamw(1e-2, weight_decay=0.1))
        return net, opt

    def train(net, opt, steps):  # type: ignore[no-untyped-def]
        for t in steps:
            net(torch.full((2, 2), float(t + 1))).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()

    net, opt = build(0)
    train(net, opt, range(2))
    osd = get_optimizer_state_dict(net, opt)
    assert osd["state"]["0.weight"] == {} and "inner_state.0.mu" in osd["state"]["1.weight"]
    dcp.save({"model": net.state_dict(), "optim": osd}, checkpoint_id=tmp_path)
    other, other_opt = build(1)
    held = {"model": other.state_dict(), "optim": get_optimizer_state_dict(other, other_opt)}
    dcp.load(held, checkpoint_id=tmp_path)
    other.load_state_dict(held["model"])
    set_optimizer_state_dict(other, other_opt, held["optim"])
    train(net, opt, range(2, 4))
    train(other, other_opt, range(2, 4))
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), other.parameters(),
                                                 strict=True))


def test_dcp_helpers_with_a_flattened_state_dict(tmp_path) -> None:
    """``StateDictOptions(flatten_optimizer_state_dict=True)``: one key per tensor and per
    group value (``state.0.weight.master``), rebuilt from ``optimizer.state``'s keys."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    net = _net(0)
    opt = _facade(net)
    _train(net, opt, range(4))
    osd = get_optimizer_state_dict(net, opt, options=flat)
    assert osd["state.0.weight.master"] is opt._state.master["0.weight"]
    dcp.save({"optim": osd}, checkpoint_id=tmp_path)
    other = _net(0)
    other_opt = _facade(other)
    held = {"optim": get_optimizer_state_dict(other, other_opt, options=flat)}
    dcp.load(held, checkpoint_id=tmp_path)
    set_optimizer_state_dict(other, other_opt, held["optim"], options=flat)
    assert _same_state(opt, other_opt)
    assert _train(net, opt, range(4, 6)) == _train(other, other_opt, range(4, 6))
    assert all(torch.equal(a, b) for a, b in zip(_bits(net), _bits(other), strict=True))
