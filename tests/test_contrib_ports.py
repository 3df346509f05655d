"""Porting from the authors' packages: the functopt call that reproduces each reference.

One law over one table (``ROWS``): a functopt transform and a ``torch.optim`` optimizer of
the reference package (the versions pinned in requirements-dev.txt) train the same float64
tree, a matrix, a vector and a 0-d leaf, for 12 steps on the same gradients (a function of
each run's own params, so the runs would drift apart if a step differed); after every step
the params agree to 1e-12, relative to the leaf's largest value. Schedule-free rows also
compare the evaluation params (``optimizer.eval()`` against ``schedule_free_eval_params``).

Where the reproduction needs an argument whose default is optax's behaviour
(``DEFAULT_DIFFERS``), the same run with that argument left at its default is at least
1e-6 away: the option is what makes the two agree. docs/contrib.md ("Coming from the
authors' packages") lists the rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch

import functopt
from functopt import contrib

F64 = torch.float64
STEPS = 12
RTOL = 1e-12
SHAPES = {"w": (5, 3), "b": (4,), "s": ()}


def _params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {k: torch.randn(shape, generator=gen, dtype=F64) for k, shape in SHAPES.items()}


def _grads(params: dict[str, torch.Tensor], t: int) -> dict[str, torch.Tensor]:
    """The gradient of a quadratic with minimum 0.5 at the params, plus noise fixed by t."""
    gen = torch.Generator().manual_seed(1000 + t)
    return {k: 0.7 * (p - 0.5) + 0.3 * torch.randn(p.shape, generator=gen, dtype=F64)
            for k, p in params.items()}


def _ref(module: str, name: str, **kwargs: Any) -> Callable[[list[torch.Tensor]], Any]:
    def build(params: list[torch.Tensor]) -> Any:
        cls = getattr(pytest.importorskip(module), name)
        return cls(params, **kwargs)

    return build


class Row(NamedTuple):
    ours: Callable[[], functopt.GradientTransformation]
    reference: Callable[[list[torch.Tensor]], Any]


C = contrib
LR = 1e-2


def _adopt_clip(t: torch.Tensor) -> torch.Tensor:
    """pytorch-optimizer's ADOPT clip, (t + 1) ** 0.25 at functopt's count t."""
    return (t + 1) ** 0.25


def _simplified_lr(count: torch.Tensor) -> torch.Tensor:
    """pytorch-optimizer's SimplifiedAdEMAMix as a learning rate of functopt's: its momentum
    is damped by 1 - b1 (functopt's, optax's, is not: hence also alpha / (1 - b1)) and its
    denominator is sqrt(v_t (1 - b2^t)) + (1 - b2^t) eps, functopt's (Adam's)
    sqrt(v_t / (1 - b2^t)) + eps times 1 - b2^t. Its foreach path keeps 1 - b2^t in float32,
    so the reference runs per parameter."""
    return LR * (1 - 0.99) / (1 - 0.95 ** (count.to(F64) + 1))


ROWS: dict[str, Row] = {
    # prodigyopt 1.1.2
    "prodigy": Row(lambda: C.prodigy(bias_correction=False),
                   _ref("prodigyopt", "Prodigy")),
    "prodigy[decay,safeguard,beta3,coef]": Row(
        lambda: C.prodigy(weight_decay=0.1, safeguard_warmup=True, beta3=0.95,
                          estim_lr_coef=0.5, bias_correction=False),
        _ref("prodigyopt", "Prodigy", weight_decay=0.1, safeguard_warmup=True, beta3=0.95,
             d_coef=0.5)),
    "prodigy[coupled decay]": Row(
        lambda: functopt.chain(functopt.add_decayed_weights(0.1),
                               C.prodigy(bias_correction=False)),
        _ref("prodigyopt", "Prodigy", weight_decay=0.1, decouple=False)),
    "prodigy[use_bias_correction,d0]": Row(
        lambda: C.prodigy(estim_lr0=1e-3),
        _ref("prodigyopt", "Prodigy", use_bias_correction=True, d0=1e-3)),
    # dadaptation 3.2
    "dadapt_adamw": Row(lambda: C.dadapt_adamw(bias_correction=False),
                        _ref("dadaptation", "DAdaptAdam")),
    "dadapt_adamw[decouple]": Row(
        lambda: C.dadapt_adamw(weight_decay=0.1, bias_correction=False),
        _ref("dadaptation", "DAdaptAdam", weight_decay=0.1, decouple=True)),
    "dadapt_adamw[coupled decay]": Row(
        lambda: functopt.chain(functopt.add_decayed_weights(0.1),
                               C.dadapt_adamw(bias_correction=False)),
        _ref("dadaptation", "DAdaptAdam", weight_decay=0.1)),
    "dadapt_adamw[use_bias_correction,d0]": Row(
        lambda: C.dadapt_adamw(estim_lr0=1e-3),
        _ref("dadaptation", "DAdaptAdam", use_bias_correction=True, d0=1e-3)),
    # schedulefree 1.4.1
    "schedule_free_adamw": Row(lambda: C.schedule_free_adamw(LR),
                               _ref("schedulefree", "AdamWScheduleFree", lr=LR)),
    "schedule_free_adamw[warmup,decay]": Row(
        lambda: C.schedule_free_adamw(LR, warmup_steps=5, weight_decay=0.1,
                                      warmup_from_zero=False),
        _ref("schedulefree", "AdamWScheduleFree", lr=LR, warmup_steps=5, weight_decay=0.1)),
    "schedule_free_sgd[warmup,decay]": Row(
        lambda: C.schedule_free_sgd(LR, warmup_steps=5, weight_decay=0.1, b1=0.8,
                                    warmup_from_zero=False),
        _ref("schedulefree", "SGDScheduleFree", lr=LR, warmup_steps=5, weight_decay=0.1,
             momentum=0.8)),
    "schedule_free_sgd[warmup_steps=1]": Row(
        lambda: C.schedule_free_sgd(LR, warmup_steps=1, warmup_from_zero=False),
        _ref("schedulefree", "SGDScheduleFree", lr=LR, warmup_steps=1)),
    "schedule_free_sgd[warmup_steps=0]": Row(
        lambda: C.schedule_free_sgd(LR, warmup_steps=0, warmup_from_zero=False),
        _ref("schedulefree", "SGDScheduleFree", lr=LR, warmup_steps=0)),
    # madgrad 1.3
    "madgrad": Row(lambda: C.madgrad(LR), _ref("madgrad", "MADGRAD", lr=LR)),
    "madgrad[coupled decay]": Row(lambda: C.madgrad(LR, weight_decay=0.1),
                                  _ref("madgrad", "MADGRAD", lr=LR, weight_decay=0.1)),
    "madgrad[decouple_decay]": Row(
        lambda: C.madgrad(LR, weight_decay=0.1, decouple_decay=True),
        _ref("madgrad", "MADGRAD", lr=LR, weight_decay=0.1, decouple_decay=True)),
    "madgrad[momentum=0]": Row(lambda: C.madgrad(LR, momentum=0.0),
                               _ref("madgrad", "MADGRAD", lr=LR, momentum=0.0)),
    # lion-pytorch 0.2.5
    "lion": Row(lambda: functopt.lion(LR, weight_decay=0.0),
                _ref("lion_pytorch", "Lion", lr=LR)),
    "lion[decay]": Row(lambda: functopt.lion(LR, b1=0.8, b2=0.95, weight_decay=0.1),
                       _ref("lion_pytorch", "Lion", lr=LR, betas=(0.8, 0.95), weight_decay=0.1)),
    "lion[decoupled_weight_decay]": Row(
        lambda: functopt.lion(LR, weight_decay=0.1 / LR),
        _ref("lion_pytorch", "Lion", lr=LR, weight_decay=0.1, decoupled_weight_decay=True)),
    # pytorch-optimizer 4.1.0
    "adopt": Row(lambda: C.adopt(LR, clip_value_fn=_adopt_clip),
                 _ref("pytorch_optimizer", "ADOPT", lr=LR)),
    "adopt[weight_decouple]": Row(
        lambda: functopt.chain(C.scale_by_adopt(clip_value_fn=_adopt_clip),
                               functopt.add_decayed_weights(0.1),
                               functopt.scale_by_learning_rate(LR)),
        _ref("pytorch_optimizer", "ADOPT", lr=LR, weight_decay=0.1, weight_decouple=True)),
    "adopt[coupled decay]": Row(
        lambda: functopt.chain(functopt.add_decayed_weights(0.1),
                               C.adopt(LR, clip_value_fn=_adopt_clip)),
        _ref("pytorch_optimizer", "ADOPT", lr=LR, weight_decay=0.1)),
    "ademamix": Row(lambda: C.ademamix(LR), _ref("pytorch_optimizer", "AdEMAMix", lr=LR)),
    "ademamix[weight_decouple]": Row(
        lambda: C.ademamix(LR, weight_decay=0.1),
        _ref("pytorch_optimizer", "AdEMAMix", lr=LR, weight_decay=0.1, weight_decouple=True)),
    "ademamix[coupled decay]": Row(
        lambda: functopt.chain(functopt.add_decayed_weights(0.1), C.ademamix(LR)),
        _ref("pytorch_optimizer", "AdEMAMix", lr=LR, weight_decay=0.1)),
    "simplified_ademamix": Row(
        lambda: C.simplified_ademamix(_simplified_lr, alpha=2.0 / (1 - 0.99)),
        _ref("pytorch_optimizer", "SimplifiedAdEMAMix", lr=LR, alpha=2.0, foreach=False)),
}

# The rows whose functopt call sets an argument away from its default, and that call with
# the argument at its default: the runs must then differ (the option is needed).
DEFAULT_DIFFERS: dict[str, Callable[[], functopt.GradientTransformation]] = {
    "prodigy": lambda: C.prodigy(),
    "dadapt_adamw": lambda: C.dadapt_adamw(),
    "schedule_free_adamw[warmup,decay]": lambda: C.schedule_free_adamw(
        LR, warmup_steps=5, weight_decay=0.1),
    "schedule_free_sgd[warmup,decay]": lambda: C.schedule_free_sgd(
        LR, warmup_steps=5, weight_decay=0.1, b1=0.8),
    "schedule_free_sgd[warmup_steps=1]": lambda: C.schedule_free_sgd(LR, warmup_steps=1),
    "lion": lambda: functopt.lion(LR),
    "adopt": lambda: C.adopt(LR),
    "madgrad[decouple_decay]": lambda: C.madgrad(LR, weight_decay=0.1),
}


def _run_ours(tx: functopt.GradientTransformation) -> tuple[list[Any], Any]:
    params = _params()
    state = tx.init(params)
    trajectory = []
    for t in range(STEPS):
        updates, state = tx.update(_grads(params, t), state, params)
        params = functopt.apply_updates(params, updates)
        trajectory.append(params)
    evaluated = (contrib.schedule_free_eval_params(state, params)
                 if isinstance(state, contrib.ScheduleFreeState) else None)
    return trajectory, evaluated


def _run_reference(build: Callable[[list[torch.Tensor]], Any]) -> tuple[list[Any], Any]:
    tensors = {k: torch.nn.Parameter(v) for k, v in _params().items()}
    opt = build(list(tensors.values()))
    schedule_free = hasattr(opt, "train") and hasattr(opt, "eval")
    if schedule_free:
        opt.train()
    trajectory = []
    for t in range(STEPS):
        with torch.no_grad():
            grads = _grads({k: p.detach() for k, p in tensors.items()}, t)
        for k, p in tensors.items():
            p.grad = grads[k].clone()
        opt.step()
        trajectory.append({k: p.detach().clone() for k, p in tensors.items()})
    evaluated = None
    if schedule_free:
        opt.eval()
        evaluated = {k: p.detach().clone() for k, p in tensors.items()}
    return trajectory, evaluated


def _worst(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for k, ref in theirs.items():
        assert ours[k].dtype == F64 and ours[k].shape == ref.shape, k
        scale = float(ref.abs().max()) or 1.0
        worst = max(worst, float((ours[k] - ref).abs().max()) / scale)
    return worst


def _worst_over_run(ours: list[Any], theirs: list[Any]) -> float:
    return max(_worst(a, b) for a, b in zip(ours, theirs, strict=True))


@pytest.mark.parametrize("name", list(ROWS))
def test_functopt_reproduces_the_reference(name: str) -> None:
    row = ROWS[name]
    theirs, theirs_eval = _run_reference(row.reference)
    ours, ours_eval = _run_ours(row.ours())
    worst = _worst_over_run(ours, theirs)
    assert worst <= RTOL, f"{name}: params differ by {worst:.2e} (relative) over {STEPS} steps"
    assert (ours_eval is None) == (theirs_eval is None)
    if theirs_eval is not None:
        assert _worst(ours_eval, theirs_eval) <= RTOL
    # the run moves the params: a row whose optimizer did nothing would pass vacuously
    assert _worst(ours[-1], _params()) > 1e-3


@pytest.mark.parametrize("name", list(DEFAULT_DIFFERS))
def test_the_options_are_needed(name: str) -> None:
    theirs, _ = _run_reference(ROWS[name].reference)
    ours, _ = _run_ours(DEFAULT_DIFFERS[name]())
    assert _worst_over_run(ours, theirs) > 1e-6


def test_every_contrib_recipe_has_a_row() -> None:
    """Each functopt.contrib recipe with a reference package is in the table (Muon's is
    torch.optim.Muon, held by functopt.optim's tests; schedule_free(base) around another
    base has no reference class)."""
    recipes = {n for n in contrib.__all__ if callable(getattr(contrib, n)) and n[0].islower()
               and not n.startswith("scale_by_")}
    covered = {name.split("[")[0] for name in ROWS}
    assert recipes - covered == {"muon", "schedule_free", "schedule_free_eval_params"}


def test_reference_packages_are_the_pinned_versions() -> None:
    """The table was made against these versions (requirements-dev.txt pins them)."""
    from importlib import metadata

    pins = {"prodigyopt": "1.1.2", "dadaptation": "3.2", "schedulefree": "1.4.1",
            "madgrad": "1.3", "lion-pytorch": "0.2.5", "pytorch-optimizer": "4.1.0"}
    for dist, version in pins.items():
        try:
            found = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pytest.skip(f"{dist} is not installed (pip install -r requirements-dev.txt)")
        assert found == version, f"{dist} {found}: the rows were checked against {version}"
