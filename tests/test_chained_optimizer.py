"""``ChainedOptimizer``: several facades stepped as one, as Megatron-LM's ``ChainedOptimizer``
(megatron-core 0.16.1) steps its optimizers: one skip decision, one norm, one clip, one
loss scale.

The reference is one ``MixedPrecisionOptimizer`` over all the params, each group with its
own transform through ``partition``: the same step with its one norm and clip computed in
one pass."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import functopt

CLIP = 0.05  # below every step's norm here: the clip acts


def _model(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _rule() -> functopt.LossScale:
    return functopt.dynamic_loss_scale(init_scale=2.0**10, growth_interval=2)


def _transform(kind: str = "adam") -> functopt.GradientTransformation:
    # (an eps near the clipped gradients' size, so that Adam's update sees the clip)
    return functopt.adamw(1e-2, eps=1e-2) if kind == "adam" else functopt.sgd(0.1, momentum=0.9)


def _chain(model: torch.nn.Module, clip: float | None = CLIP) -> functopt.ChainedOptimizer:
    dense = functopt.MixedPrecisionOptimizer(model[0].named_parameters(prefix="0"),
                                             _transform("adam"), loss_scale=_rule())
    head = functopt.MixedPrecisionOptimizer(model[2].named_parameters(prefix="2"),
                                            _transform("sgd"), loss_scale=_rule())
    for opt in (dense, head):
        opt.clip_grad_norm(None, clip)
    return functopt.ChainedOptimizer([dense, head])


def _one(model: torch.nn.Module) -> functopt.MixedPrecisionOptimizer:
    opt = functopt.MixedPrecisionOptimizer(
        [{"params": list(model[0].named_parameters(prefix="0")), "kind": "adam"},
         {"params": list(model[2].named_parameters(prefix="2")), "kind": "sgd"}],
        _transform, loss_scale=_rule(), return_grad_stats=True)
    opt.clip_grad_norm(None, CLIP)
    return opt


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(50 + step)
    return model(torch.randn(8, 4, generator=g)).pow(2).mean()


OVERFLOW = 2  # the step whose head gradient holds an inf


def _run(opt: Any, model: torch.nn.Module, steps: int,
         step: Any = None) -> list[tuple[Any, float, list[torch.Tensor]]]:
    out = []
    for k in range(steps):
        opt.backward(_loss(model, k))
        if k == OVERFLOW:
            model[2].weight.grad[0, 0] = float("inf")
        result = opt.step() if step is None else step(opt)
        opt.zero_grad()
        out.append((result, opt.loss_scale, [p.detach().clone() for p in model.parameters()]))
    return out


def test_the_chain_steps_as_one_optimizer_over_all_params() -> None:
    """One skip decision (an inf in the head's gradient skips the dense params too), one
    norm over both, one clip by it, one loss scale: as one facade over both groups."""
    chained_model, one_model = _model(), _model()
    chain = _chain(chained_model)
    got = _run(chain, chained_model, 6)
    want = _run(_one(one_model), one_model, 6)
    for k, ((result, scale, params), (ref, ref_scale, ref_params)) in enumerate(
            zip(got, want, strict=True)):
        assert result[0] == ref[0] == (k != OVERFLOW)
        assert scale == ref_scale
        if result[0]:
            assert result[1] == pytest.approx(ref[1], rel=1e-6)
        else:
            assert result == (False, None, None)
        for p, q in zip(params, ref_params, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
    # the skipped step left every param as it was, the dense ones too
    assert all(torch.equal(p, q) for p, q in zip(got[OVERFLOW][2], got[OVERFLOW - 1][2],
                                                 strict=True))
    # one loss scale: each optimizer's, backed off and grown together
    assert [opt.loss_scale for opt in chain.chained_optimizers] == [got[-1][1]] * 2
    assert got[OVERFLOW][1] == got[OVERFLOW - 1][1] / 2 < got[-1][1]


def test_megatrons_halves_are_the_chains_step() -> None:
    """megatron-core's ``ChainedOptimizer.step``, transcribed: ``prepare_grads``, the norm,
    the clip and ``step_with_ready_grads`` (here ``step`` clips, so the transcription
    lets the chain's halves and ``step`` meet on unclipped runs)."""
    def megatron(chain: functopt.ChainedOptimizer) -> tuple[Any, ...]:
        if chain.prepare_grads():
            return False, None, None
        norm = float(chain.get_grad_norm())
        return chain.step_with_ready_grads(), norm, None

    a_model, b_model = _model(), _model()
    got = _run(_chain(a_model, clip=None), a_model, 5, step=megatron)
    want = _run(_chain(b_model, clip=None), b_model, 5)
    for (result, scale, params), (ref, ref_scale, ref_params) in zip(got, want, strict=True):
        assert result[0] == ref[0] and scale == ref_scale
        if ref[0]:
            assert result[1] == pytest.approx(ref[1], rel=1e-6)
        assert all(torch.equal(p, q) for p, q in zip(params, ref_params, strict=True))


def test_the_chains_state_dict_resumes_the_run() -> None:
    first, second = _model(), _model()
    chain = _chain(first)
    _run(chain, first, 3)
    saved = chain.state_dict()
    assert isinstance(saved, list) and len(saved) == 2
    resumed = _chain(second)
    second.load_state_dict(first.state_dict())
    resumed.load_state_dict(saved)
    assert resumed.loss_scale == chain.loss_scale
    for k in range(3, 5):
        for model, opt in ((first, chain), (second, resumed)):
            opt.backward(_loss(model, k))
            assert opt.step()[0]
            opt.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(first.parameters(), second.parameters(),
                                                   strict=True))
    with pytest.raises(ValueError, match="expected a list of 2 state dicts"):
        resumed.load_state_dict(saved[0])


def test_what_megatrons_callers_read_is_the_optimizers_in_order() -> None:
    model = _model()
    chain = _chain(model)
    dense, head = chain.chained_optimizers
    assert chain.param_groups == dense.param_groups + head.param_groups
    chain.param_groups[1]["lr"] = 0.5  # a scheduler's write reaches the optimizer
    assert head.param_groups[0]["lr"] == 0.5
    assert [id(p) for p in chain.get_parameters()] == [
        id(p) for p in (*model[0].parameters(), *model[2].parameters())]
    chain.backward(_loss(model, 0))
    grads = chain.get_main_grads_for_grad_norm()
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    torch.testing.assert_close(norm, chain.get_grad_norm(), rtol=1e-6, atol=0.0)
    chain.step()
    state = chain.state
    assert len(state) == len(dense.state) + len(head.state) == 4
    for (index, p), entry in state.items():
        assert chain.chained_optimizers[index].state[p] is entry or (
            entry.keys() == chain.chained_optimizers[index].state[p].keys())
    assert [k for k, _ in state] == [0, 0, 1, 1]


def test_a_chain_that_cannot_be_one_step_is_refused() -> None:
    model = _model()

    def facade(params: Any, **options: Any) -> functopt.MixedPrecisionOptimizer:
        options.setdefault("loss_scale", _rule())
        return functopt.MixedPrecisionOptimizer(params, _transform(), **options)

    dense = facade(model[0].named_parameters(prefix="0"))
    with pytest.raises(ValueError, match="loss scale"):
        functopt.ChainedOptimizer([dense, facade(model[2].named_parameters(prefix="2"),
                                                 loss_scale=None)])
    clipped = facade(model[2].named_parameters(prefix="2"))
    clipped.clip_grad_norm(None, 1.0)
    with pytest.raises(ValueError, match=r"clips at 1\.0, optimizer 0 at None"):
        functopt.ChainedOptimizer([dense, clipped])
    with pytest.raises(ValueError, match="grad_norm_skip_threshold"):
        functopt.ChainedOptimizer([dense, facade(model[2].named_parameters(prefix="2"),
                                                 grad_norm_skip_threshold=10.0)])
    with pytest.raises(ValueError, match="both update a param"):
        functopt.ChainedOptimizer([dense, facade(model[0].named_parameters(prefix="0"))])
    with pytest.raises(TypeError, match="optimizer 1 is a SGD"):
        functopt.ChainedOptimizer([dense, torch.optim.SGD(model[2].parameters(), lr=0.1)])
    with pytest.raises(ValueError, match="no optimizers"):
        functopt.ChainedOptimizer([])
