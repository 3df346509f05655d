"""functopt.optim.Muon against torch.optim.Muon.

torch iterates Newton-Schulz in bfloat16. Two laws hold the drop-in to it: in float64, with
torch's cast to bfloat16 replaced by a copy (so that both iterate in float64) and
``ns_dtype=None``, every configuration of torch's optim_db (and a few more rows) trains the
same params for 10 steps to 1e-12 of the largest param; in float32 with the default
bfloat16 iteration, each step's update is within bfloat16 rounding of torch's. The rest
checks the drop-in's contract: constructor errors, fixed and per-group options, state
dicts both ways, params without a gradient, the per-leaf tier.
"""

from __future__ import annotations

import copy
import io
from typing import Any
from unittest import mock

import pytest
import torch
from torch.testing._internal.common_optimizers import OptimizerErrorEnum, optim_db

import functopt
from functopt import optim

ENTRY = next(e for e in optim_db if e.optim_cls.__name__ == "Muon")
STEPS = 10
SHAPES = [(4, 3), (3, 4), (5, 5), (1, 6), (6, 5)]
# rows optim_db does not list
EXTRA = [{"nesterov": False}, {"adjust_lr_fn": "original", "lr": 0.05},
         {"adjust_lr_fn": "match_rms_adamw", "lr": 0.05}, {"weight_decay": 0.0},
         {"eps": 1e-3, "momentum": 0.5}, {"ns_steps": 1}]


def _params(dtype: torch.dtype = torch.float64, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in SHAPES]


def _grads(params: list[torch.Tensor], t: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + t)
    return [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]


def _train(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int,
           start: int = 0, skip: tuple[int, ...] = ()) -> None:
    for t in range(start, start + steps):
        for i, (p, g) in enumerate(zip(params, _grads(params, t), strict=True)):
            p.grad = None if (t < 3 and i in skip) else g
        opt.step()


def _worst(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    scale = max(float(x.detach().abs().max()) for x in b)
    return max(float((x - y).detach().abs().max()) for x, y in zip(a, b, strict=True)) / scale


def _iterating_wide() -> Any:
    # torch.optim.Muon casts to bfloat16 with Tensor.bfloat16(): a copy keeps its dtype
    return mock.patch.object(torch.Tensor, "bfloat16", lambda self: self.clone())


def _configs() -> list[Any]:
    rows = [pytest.param(c.desc, id=c.desc) for c in ENTRY.optim_inputs_func(device="cpu")]
    return rows + [pytest.param(i, id=f"extra{i}") for i in range(len(EXTRA))]


def _config(row: str | int) -> dict[str, Any]:
    # read at test time, under the float64 default: optim_db's Tensor lr is then float64
    # (torch.optim.Muon computes 1 - lr * weight_decay and the adjusted lr in the tensor
    # lr's dtype)
    if isinstance(row, int):
        return dict(EXTRA[row])
    (found,) = [c for c in ENTRY.optim_inputs_func(device="cpu") if c.desc == row]
    return dict(found.kwargs)


@pytest.mark.parametrize("row", _configs())
def test_matches_torch_in_float64(row: str | int, float64_default: None) -> None:
    kwargs = _config(row)
    ours, theirs = _params(), _params()
    with _iterating_wide():
        _train(optim.Muon(ours, ns_dtype=None, **kwargs), ours, STEPS)
        _train(torch.optim.Muon(theirs, **kwargs), theirs, STEPS)
    moved = _worst(_params(), theirs)
    assert moved > 1e-3  # (the run moves the params)
    assert _worst(ours, theirs) <= 1e-12


def test_groups_with_their_own_lr_momentum_and_weight_decay_match_torch() -> None:
    def groups(ps: list[torch.nn.Parameter]) -> list[dict[str, Any]]:
        return [{"params": ps[:2]}, {"params": ps[2:4], "lr": 0.05, "momentum": 0.8},
                {"params": ps[4:], "weight_decay": 0.0}]

    ours, theirs = _params(), _params()
    with _iterating_wide():
        _train(optim.Muon(groups(ours), lr=0.02, ns_dtype=None), ours, STEPS)
        _train(torch.optim.Muon(groups(theirs), lr=0.02), theirs, STEPS)
    assert _worst(ours, theirs) <= 1e-12
    # and a group's values are read at each step: a scheduler moves lr
    ours, theirs = _params(), _params()
    a, b = optim.Muon(ours, lr=0.1, ns_dtype=None), torch.optim.Muon(theirs, lr=0.1)
    sa, sb = (torch.optim.lr_scheduler.StepLR(o, 2, 0.5) for o in (a, b))
    with _iterating_wide():
        for t in range(6):
            _train(a, ours, 1, start=t)
            _train(b, theirs, 1, start=t)
            sa.step()
            sb.step()
    assert a.param_groups[0]["lr"] == b.param_groups[0]["lr"] == 0.0125
    assert _worst(ours, theirs) <= 1e-12


@pytest.mark.parametrize("kwargs", [{}, {"nesterov": False},
                                    {"adjust_lr_fn": "match_rms_adamw"}], ids=str)
@pytest.mark.parametrize("shape", [(64, 64), (48, 96), (96, 40), (2, 2)], ids=str)
def test_bfloat16_iteration_within_bfloat16_rounding_of_torch(
        kwargs: dict[str, Any], shape: tuple[int, int]) -> None:
    # from the same param and momentum each step (torch's, loaded into functopt's), the
    # step's update is torch's to a few bfloat16 roundings of its largest entry
    lr = 0.1
    w = torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(1)))
    t = torch.nn.Parameter(w.detach().clone())
    ours, theirs = optim.Muon([w], lr=lr, **kwargs), torch.optim.Muon([t], lr=lr, **kwargs)
    eps16 = torch.finfo(torch.bfloat16).eps
    for step in range(4):
        if step:
            ours.load_state_dict(copy.deepcopy(theirs.state_dict()))
            with torch.no_grad():
                w.copy_(t)
        before = t.detach().clone()
        g = torch.randn(shape, generator=torch.Generator().manual_seed(10 + step))
        w.grad, t.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
        update = (t - before * (1 - lr * theirs.param_groups[0]["weight_decay"])).detach()
        diff = float((w - t).detach().abs().max())
        assert diff <= 4 * eps16 * float(update.abs().max()), (step, diff)
        assert w.dtype == torch.float32


def _error_inputs() -> list[Any]:
    return [pytest.param(e, id=e.optimizer_error_input.desc)
            for e in ENTRY.optim_error_inputs_func(device="cpu", dtype=torch.float64)
            if e.error_on == OptimizerErrorEnum.CONSTRUCTION_ERROR]


@pytest.mark.parametrize("error", _error_inputs())
def test_rejects_optim_db_error_inputs(error: Any) -> None:
    given = error.optimizer_error_input
    if issubclass(error.error_type, Warning):
        with pytest.warns(error.error_type, match=error.error_regex):
            optim.Muon(given.params, **given.kwargs)
    else:
        with pytest.raises(error.error_type, match=error.error_regex):
            optim.Muon(given.params, **given.kwargs)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"momentum": 1.0}, "momentum should be < 1"),
    ({"momentum": -0.1}, "momentum should be >= 0"),
    ({"ns_coefficients": (3.0, -4.0)}, "exactly 3 numbers"),
    ({"ns_steps": 100}, r"ns_steps must be an int in \[1, 100\)"),
    ({"ns_steps": 0}, r"ns_steps must be an int in \[1, 100\)"),
    ({"weight_decay": -0.1}, "weight_decay"),
])
def test_bad_options_are_refused_naming_them(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        optim.Muon(_params(), **kwargs)


def test_every_param_of_every_group_is_a_matrix() -> None:
    ps = _params()
    opt = optim.Muon(ps)
    bias = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"size: torch.Size\(\[3\]\) \(param 0 of group 1\)"):
        opt.add_param_group({"params": [bias]})
    assert len(opt.param_groups) == 1  # the refused group is not kept
    with pytest.raises(ValueError, match="AdamW"):
        optim.Muon([{"params": ps}, {"params": [bias]}])


@pytest.mark.parametrize(("key", "value"), [("nesterov", False), ("ns_steps", 3),
                                            ("ns_coefficients", (3.0, -4.0, 2.0)),
                                            ("eps", 1e3), ("adjust_lr_fn", "match_rms_adamw")])
def test_groups_with_their_own_options_match_torch(key: str, value: Any) -> None:
    def groups(ps: list[torch.nn.Parameter]) -> list[dict[str, Any]]:
        return [{"params": ps[:2]}, {"params": ps[2:], key: value}]

    ours, theirs, alone = _params(), _params(), _params()
    with _iterating_wide():
        _train(optim.Muon(groups(ours), lr=0.02, ns_dtype=None), ours, STEPS)
        _train(torch.optim.Muon(groups(theirs), lr=0.02), theirs, STEPS)
        _train(optim.Muon(alone, lr=0.02, ns_dtype=None), alone, STEPS)
    assert _worst(ours, theirs) <= 1e-12
    assert all(torch.equal(a, o) for a, o in zip(alone[:2], ours[:2], strict=True))
    assert _worst(alone[2:], ours[2:]) > 1e-6  # (the option changes the second group)


def test_weight_decay_of_a_group_adds_the_stage_and_zero_everywhere_is_fixed() -> None:
    def groups(ps: list[torch.nn.Parameter]) -> list[dict[str, Any]]:
        return [{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.1}]

    ours, theirs = _params(), _params()
    with _iterating_wide():
        _train(optim.Muon(groups(ours), weight_decay=0.0, ns_dtype=None), ours, 4)
        _train(torch.optim.Muon(groups(theirs), weight_decay=0.0), theirs, 4)
    assert _worst(ours, theirs) <= 1e-12
    # no group decays: the chain has no decay stage, and a value written after the first
    # step is refused
    ps = _params()
    opt = optim.Muon(ps, weight_decay=0.0)
    assert "weight_decay" not in opt.transform.init([p.detach() for p in ps]).hyperparams
    _train(opt, ps, 1)
    opt.param_groups[0]["weight_decay"] = 0.1
    with pytest.raises(ValueError, match=r"changed weight_decay=0\.0 -> 0\.1 after its first"):
        opt.step()


def _through_file(state_dict: dict[str, Any]) -> Any:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("direction", ["torch to functopt", "functopt to torch"])
def test_state_dict_continues_the_run_on_the_other_side(direction: str) -> None:
    # 3 steps on one side (one param without a gradient: no state for it), the state dict
    # through a file into the other side, 3 more there: an uninterrupted 6-step run
    first, second = ((torch.optim.Muon, optim.Muon) if direction == "torch to functopt"
                     else (optim.Muon, torch.optim.Muon))

    def build(cls: type, ps: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return cls(ps, lr=0.05, ns_dtype=None) if cls is optim.Muon else cls(ps, lr=0.05)

    with _iterating_wide():
        ps = _params()
        a = build(first, ps)
        _train(a, ps, 3, skip=(1,))
        state = _through_file(a.state_dict())
        assert sorted(state["state"]) == [0, 2, 3, 4]
        assert all(sorted(s) == ["momentum_buffer"] for s in state["state"].values())
        b = build(second, ps)
        b.load_state_dict(state)
        _train(b, ps, 3, start=3)
        ref = _params()
        c = build(second, ref)
        _train(c, ref, 6, skip=(1,))
    assert _worst(ps, ref) <= 1e-12


def test_a_param_without_a_gradient_keeps_its_value_and_momentum() -> None:
    ours, theirs = _params(), _params()
    with _iterating_wide():
        _train(optim.Muon(ours, ns_dtype=None), ours, 6, skip=(0, 3))
        _train(torch.optim.Muon(theirs), theirs, 6, skip=(0, 3))
    assert _worst(ours, theirs) <= 1e-12


def test_runs_on_the_per_leaf_tier_with_the_iteration_batched(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from functopt.contrib import _muon

    seen: list[tuple[tuple[int, ...], torch.dtype]] = []
    real = _muon._orthogonalize

    def counting(x: torch.Tensor, *args: Any) -> torch.Tensor:
        seen.append((tuple(x.shape), x.dtype))
        return real(x, *args)

    monkeypatch.setattr(_muon, "_orthogonalize", counting)
    ps = [torch.nn.Parameter(torch.randn(8, 8)) for _ in range(3)]
    ps.append(torch.nn.Parameter(torch.randn(8, 4)))
    opt = optim.Muon(ps, lr=0.02)
    report = functopt.fast.explain(opt.transform, [p.detach() for p in ps])
    assert report.fast, report
    assert [g.kernel for g in report.groups] == ["per-leaf"], report
    seen.clear()
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    # one iteration for the three 8 x 8 matrices, one for the 8 x 4 (its (in, out) view),
    # in bfloat16
    assert sorted(seen) == [((1, 4, 8), torch.bfloat16), ((3, 8, 8), torch.bfloat16)]


class _LM(torch.nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.block = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(),
                                         torch.nn.Linear(8, 6, bias=False))
        self.norm = torch.nn.LayerNorm(6)
        self.conv = torch.nn.Conv1d(6, 6, 3)
        self.lm_head = torch.nn.Linear(6, 11, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight


@pytest.mark.parametrize("tied", [False, True], ids=["untied head", "head tied to embed"])
def test_muon_split_sends_hidden_matrices_to_muon_and_the_rest_to_adamw(tied: bool) -> None:
    model = _LM(tied)
    hidden, rest = optim.muon_split(model)
    assert [id(p) for p in hidden] == [id(model.block[0].weight), id(model.block[2].weight)]
    # each param once, in model.parameters() order
    assert sorted(map(id, hidden + rest)) == sorted(map(id, model.parameters()))
    assert [id(p) for p in rest] == [id(p) for p in model.parameters()
                                     if all(p is not q for q in hidden)]
    # heads by other names
    hidden, _ = optim.muon_split(model, heads=("lm_head", "block.2"))
    assert [id(p) for p in hidden] == [id(model.block[0].weight)]


@pytest.mark.parametrize(("model", "heads", "match"), [
    ([torch.nn.Parameter(torch.ones(2, 2))], ("lm_head",), "must be a torch.nn.Module"),
    (torch.nn.Linear(2, 2), "lm_head", r"heads=\('lm_head',\)"),
])
def test_muon_split_refuses_what_it_cannot_read(model: Any, heads: Any, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        optim.muon_split(model, heads=heads)
