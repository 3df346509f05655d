"""What the adapters' per-step caches must not change: a group edit after steps reaches the
next step exactly as in torch.optim.

``functopt.Optimizer`` keeps the tensors of a group's hyperparameters from one step to the
next while the group holds the very same values, and ``functopt.optim`` skips torch's range
checks of values it checked already. Golden values come from ``torch.optim.AdamW``
(``foreach=False``) taking the same steps with the same edits, in float64.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import functopt

F64 = torch.float64
STEPS = 3


@pytest.fixture(autouse=True)
def float64_default() -> Iterator[None]:
    # torch.optim keeps its step counts in the default dtype (its bias correction reads them)
    before = torch.get_default_dtype()
    torch.set_default_dtype(F64)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, generator=g, dtype=F64))
            for shape in ((4, 3), (3,), (2, 2))]


def _grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(shape, generator=g, dtype=F64) for shape in ((4, 3), (3,), (2, 2))]


def _torch(params: Any, **kwargs: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.999), eps=1e-8,
                             weight_decay=0.1, foreach=False, **kwargs)


def _plain(params: Any) -> torch.optim.Optimizer:
    return functopt.Optimizer(params, functopt.adamw(1e-2, b1=0.9, b2=0.999, eps=1e-8,
                                                     weight_decay=0.1))


def _optim(params: Any) -> torch.optim.Optimizer:
    return functopt.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.999), eps=1e-8,
                                weight_decay=0.1)


OURS = {"functopt.Optimizer(adamw)": _plain, "functopt.optim.AdamW": _optim}


def _run(make: Callable[[Any], torch.optim.Optimizer],
         edits: list[Callable[[torch.optim.Optimizer], None]]) -> list[torch.Tensor]:
    """STEPS steps, then per edit: the edit and one step; the final params."""
    params = _params()
    opt = make(params)
    step = 0
    for edit in [lambda _: None] * STEPS + edits:
        edit(opt)
        for p, g in zip(params, _grads(step), strict=True):
            p.grad = g
        opt.step()
        step += 1
    return [p.detach() for p in params]


def _stepped(make: Callable[[Any], torch.optim.Optimizer],
             ) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    """The params and an optimizer over them after STEPS steps (the grads of the last one
    still set)."""
    params = _params()
    opt = make(params)
    for step in range(STEPS):
        for p, g in zip(params, _grads(step), strict=True):
            p.grad = g
        opt.step()
    return params, opt


def _close(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    scale = max(float(r.abs().max()) for r in ref)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0.0, atol=1e-12 * scale)


def _set(key: str, value: Any) -> Callable[[torch.optim.Optimizer], None]:
    def edit(opt: torch.optim.Optimizer) -> None:
        for group in opt.param_groups:
            group[key] = value
    return edit


EDITS = {
    "lr": [_set("lr", 3e-2), lambda opt: None, _set("lr", 1e-3)],
    "weight_decay": [_set("weight_decay", 0.0), _set("weight_decay", 0.5)],
    "betas": [_set("betas", (0.5, 0.9)), lambda opt: None, _set("betas", (0.95, 0.99))],
    "eps": [_set("eps", 1e-3)],
    "all at once": [lambda opt: opt.param_groups[0].update(lr=5e-3, betas=(0.8, 0.99),
                                                           weight_decay=0.01)],
}


@pytest.mark.parametrize("name", sorted(OURS))
@pytest.mark.parametrize("case", sorted(EDITS))
def test_a_group_edit_after_steps_reaches_the_next_step_as_in_torch(name: str,
                                                                     case: str) -> None:
    ours = _run(OURS[name], EDITS[case])
    ref = _run(_torch, EDITS[case])
    _close(ours, ref)
    # the edit is no no-op: without it torch's params differ
    unedited = _run(_torch, [lambda opt: None] * len(EDITS[case]))
    assert any(not torch.allclose(a, b) for a, b in zip(unedited, ref, strict=True))


@pytest.mark.parametrize("name", sorted(OURS))
def test_an_equal_value_in_a_new_object_gives_the_same_step(name: str) -> None:
    # float("0.01") is another object than the 1e-2 the groups hold: read anew, same result
    ours = _run(OURS[name], [_set("lr", float("0.01")), _set("betas", (0.9, 0.999))])
    _close(ours, _run(_torch, [lambda opt: None, lambda opt: None]))


@pytest.mark.parametrize("name", sorted(OURS))
def test_a_tensor_lr_changed_in_place_is_read_at_every_step(name: str) -> None:
    lr = torch.tensor(1e-2, dtype=F64)

    def put(opt: torch.optim.Optimizer) -> None:
        opt.param_groups[0]["lr"] = lr

    ours = _run(OURS[name], [put, lambda opt: lr.fill_(1e-3), lambda opt: lr.fill_(5e-2)])
    ref = _run(_torch, [lambda opt: None, _set("lr", 1e-3), _set("lr", 5e-2)])
    _close(ours, ref)


@pytest.mark.parametrize("name", sorted(OURS))
def test_a_multiplier_set_after_steps_is_refused_and_a_written_lr_takes_effect(
        name: str) -> None:
    params, opt = _stepped(OURS[name])
    before = [p.detach().clone() for p in params]
    lr = opt.param_groups[0]["lr"]
    opt.param_groups[0]["lr_mult"] = 0.0  # it would change nothing: the lr holds products
    with pytest.raises(ValueError, match=r"changed lr_mult / wd_mult to 0\.0 / 1\.0"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params, before, strict=True))
    opt.param_groups[0]["lr_mult"] = 1.0
    opt.param_groups[0]["lr"] = 0.0  # AdamW's decay scales with lr: nothing moves
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params, before, strict=True))
    opt.param_groups[0]["lr"] = lr
    opt.step()
    assert not any(torch.equal(a, b) for a, b in zip(params, before, strict=True))


@pytest.mark.parametrize("name", sorted(OURS))
def test_a_bad_value_written_after_steps_still_raises(name: str) -> None:
    params, opt = _stepped(OURS[name])
    kept = [p.detach().clone() for p in params]
    bad: list[tuple[str, Any]] = [("betas", (1.0, 0.999)), ("eps", -1.0)]
    if name == "functopt.optim.AdamW":  # torch's range checks, on top of the recipe's
        bad += [("lr", -1.0), ("weight_decay", -0.1)]
    for key, value in bad:
        good = opt.param_groups[0][key]
        opt.param_groups[0][key] = value
        with pytest.raises(ValueError):
            opt.step()
        opt.param_groups[0][key] = good
    assert all(torch.equal(a, b) for a, b in zip(params, kept, strict=True))
    opt.step()  # the good values step again


@pytest.mark.parametrize("name", sorted(OURS))
def test_a_group_added_after_steps_steps_as_in_torch(name: str) -> None:
    def run(make: Callable[[Any], torch.optim.Optimizer]) -> list[torch.Tensor]:
        params = _params()
        opt = make(params[:2])
        for step in range(2 * STEPS):
            if step == STEPS:
                opt.add_param_group({"params": [params[2]], "lr": 3e-2, "weight_decay": 0.0})
            for p, g in zip(params, _grads(step), strict=True):
                p.grad = g
            opt.step()
            opt.param_groups[-1]["lr"] *= 0.5  # edits of either group after the add
        return [p.detach() for p in params]

    _close(run(OURS[name]), run(_torch))


@pytest.mark.parametrize("name", sorted(OURS))
def test_load_state_dict_then_step_as_in_torch(name: str) -> None:
    def run(make: Callable[[Any], torch.optim.Optimizer]) -> list[torch.Tensor]:
        params = _params()
        opt = make(params)
        saved = None
        for step in range(2 * STEPS):
            if step == STEPS - 1:
                saved = opt.state_dict()
                saved = {"state": {k: {n: t.clone() for n, t in v.items()}
                                   for k, v in saved["state"].items()},
                         **{k: v for k, v in saved.items() if k != "state"}}
                saved["param_groups"][0]["lr"] = 2e-2  # a value the cache never saw
            if step == STEPS + 1:
                assert saved is not None
                opt.load_state_dict(saved)  # back two steps' state, the new lr
            for p, g in zip(params, _grads(step), strict=True):
                p.grad = g
            opt.step()
        return [p.detach() for p in params]

    _close(run(OURS[name]), run(_torch))


@pytest.mark.parametrize("name", sorted(OURS))
def test_unchanged_group_values_are_not_read_on_the_host_again(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The group's values (here with the multipliers folded in when it was added), kept
    # from step to step: the planner's memo of host reads holds them (on an accelerator
    # each .item() is a synchronisation).
    params = _params()
    opt = OURS[name]([{"params": params, "lr_mult": 2.0, "wd_mult": 0.5}])
    reads = []
    item = torch.Tensor.item

    def counted(self: torch.Tensor) -> Any:
        reads.append(self)
        return item(self)

    for step in range(2 * STEPS):
        if step == STEPS:
            monkeypatch.setattr(torch.Tensor, "item", counted)
        for p, g in zip(params, _grads(step), strict=True):
            p.grad = g
        opt.step()
    assert reads == []
    opt.param_groups[0]["lr"] = 3e-2  # a new value: read at the next step, once
    opt.step()
    # the new lr alone, used as written (a host tensor here, which the kernels take as a
    # float); the weight decay is the memo's
    assert len(reads) == 1


# -- optimizer.state between steps: updated in place, read anew at every step -------------

_TORCH_KEYS = {"count": "step", "inner_state.0.mu": "exp_avg",
               "inner_state.0.nu": "exp_avg_sq"}


def _key(name: str, key: str) -> str:
    """``key`` of functopt.Optimizer's layout in the optimizer ``name``'s optimizer.state
    (a functopt.optim class shows torch's keys)."""
    if name == "functopt.Optimizer(adamw)":
        return key
    return _TORCH_KEYS.get(key, "step" if key.endswith("count") else key)


@pytest.mark.parametrize("name", sorted(OURS))
def test_the_state_entries_follow_every_step_as_in_torch(name: str) -> None:
    params, opt = _stepped(OURS[name])
    ref_params, ref = _stepped(_torch)
    for extra in range(2):  # warm steps: the entries are updated where they are
        for p, q, g in zip(params, ref_params, _grads(STEPS + extra), strict=True):
            p.grad, q.grad = g, g.clone()
        opt.step()
        ref.step()
        for p, q in zip(params, ref_params, strict=True):
            entry, theirs = opt.state[p], ref.state[q]
            assert int(entry[_key(name, "inner_state.0.count")]) == STEPS + extra + 1
            for key, torch_key in _TORCH_KEYS.items():
                torch.testing.assert_close(entry[_key(name, key)].to(F64),
                                           theirs[torch_key].to(F64), rtol=1e-12, atol=0)
        # the group's counter: one tensor, in every param's entry the step reads
        assert len({id(opt._made_store()[p]["count"]) for p in params}) == 1


@pytest.mark.parametrize("name", sorted(OURS))
def test_a_state_dict_taken_keeps_its_values_over_later_steps(name: str) -> None:
    params, opt = _stepped(OURS[name])
    saved = opt.state_dict()
    snapshot = {k: {n: t.clone() for n, t in v.items()} for k, v in saved["state"].items()}
    for _ in range(3):  # the first step writes new tensors, the next ones update them
        opt.step()
    for k, entry in saved["state"].items():
        assert set(entry) == set(snapshot[k])
        for n, t in entry.items():
            assert torch.equal(t, snapshot[k][n]), (k, n)
    assert int(opt.state[params[0]][_key(name, "count")]) == STEPS + 3


@pytest.mark.parametrize("name", sorted(OURS))
def test_a_moment_replaced_between_steps_is_read_as_in_torch(name: str) -> None:
    params, opt = _stepped(OURS[name])
    ref_params, ref = _stepped(_torch)
    # a user's edit of the state, as torch.optim allows: a moment reset to zeros
    opt.state[params[0]][_key(name, "inner_state.0.mu")] = torch.zeros_like(params[0])
    ref.state[ref_params[0]]["exp_avg"] = torch.zeros_like(ref_params[0])
    opt.step()
    ref.step()
    _close([p.detach() for p in params], [q.detach() for q in ref_params])
    unedited, _ = _stepped(_torch)
    assert not torch.allclose(unedited[0], ref_params[0])


@pytest.mark.parametrize("name", sorted(OURS))
def test_group_flags_changed_after_steps_take_effect(name: str) -> None:
    params, opt = _stepped(OURS[name])
    opt.param_groups[0]["lr_mult"] = -1.0
    with pytest.raises(ValueError, match=r"lr_mult=-1\.0"):
        opt.step()
    opt.param_groups[0]["lr_mult"] = 1.0
    opt.param_groups[0]["frozen"] = True
    before = [p.detach().clone() for p in params]
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params, before, strict=True))


def test_a_fixed_option_changed_after_steps_still_raises() -> None:
    _, opt = _stepped(_optim)
    opt.param_groups[0]["amsgrad"] = True
    with pytest.raises(ValueError, match="changed amsgrad=False -> True after its first step"):
        opt.step()
    opt.param_groups[0]["amsgrad"] = False
    opt.step()  # the built value steps again


@pytest.mark.parametrize("edit", ["deleted", "None"])
def test_a_state_entry_lost_between_warm_steps_raises_naming_it(edit: str) -> None:
    params, opt = _stepped(_plain)
    if edit == "deleted":
        del opt.state[params[1]]["inner_state.0.nu"]
    else:
        opt.state[params[1]]["inner_state.0.nu"] = None
    with pytest.raises(ValueError, match=r"param 1 of param_groups\[0\] has no "
                                         r"'inner_state.0.nu'"):
        opt.step()


@pytest.mark.parametrize("name", sorted(OURS))
def test_a_gradient_of_other_strides_after_steps_steps_as_in_torch(name: str) -> None:
    params, opt = _stepped(OURS[name])
    ref_params, ref = _stepped(_torch)
    g = _grads(STEPS)
    # the same values laid out column-major: other strides than the params
    for ps in (params, ref_params):
        for p, grad in zip(ps, g, strict=True):
            p.grad = grad.clone()
        ps[2].grad = g[2].t().contiguous().t()
        ps[0].grad = g[0].t().contiguous().t()
    opt.step()
    ref.step()
    _close([p.detach() for p in params], [q.detach() for q in ref_params])


@pytest.mark.parametrize("name", sorted(OURS))
def test_named_params_out_of_name_order_step_as_in_torch(name: str) -> None:
    # the transform sees a named group as a dict, which flattens by sorted name: the
    # optimizer hands the kernels its params in that order, each with its own gradient
    def run(make: Callable[[Any], torch.optim.Optimizer], named: bool) -> list[torch.Tensor]:
        params = _params()
        names = ["z", "a", "m"]
        opt = make(list(zip(names, params, strict=True)) if named else params)
        for step in range(STEPS + 2):
            for p, g in zip(params, _grads(step), strict=True):
                p.grad = g
            opt.step()
        return [p.detach() for p in params]

    _close(run(OURS[name], True), run(_torch, False))
