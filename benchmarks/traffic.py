"""The memory traffic of a step, per param: ``functopt.fast.explain``'s count for each form
of a step, beside the same count taken on PyTorch's step for the same maths.

An optimizer step is bound by memory bandwidth on an accelerator, so its bytes per param
predict its time there: the table gives the time each count implies for 10M params at an
H200's 4.8 TB/s. functopt's counts come from ``explain`` (from the plan for PyTorch's
kernels and the compiled tier, from a run on meta tensors for the eager tiers); PyTorch's
from the same dispatch-mode count (``functopt/fast/_traffic.py``) over one real step on
the CPU. Nothing is timed.

Usage: ``python benchmarks/traffic.py`` (or ``benchmarks/run.py --only traffic``).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # functopt from this checkout

import torch

import functopt
from functopt import contrib
from functopt.fast import _traffic, explain, make_step
from functopt.precision import mixed_precision

H200_BYTES_PER_S = 4.8e12
PARAMS = 10_000_000


def _tree(shape: tuple[int, ...], leaves: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {f"p{i}": torch.randn(*shape) for i in range(leaves)}


def _functopt(name: str, tx: Any, params: dict[str, torch.Tensor], **flags: Any) -> dict[str, Any]:
    """``explain``'s count for ``make_step(tx, **flags)`` on ``params``."""
    step = make_step(tx, **flags)
    grads = {k: torch.randn_like(p) for k, p in params.items()}
    state = step.init(params)
    got = explain(tx, params, state, grads, compile=flags.get("compile", False),
                  donate=flags.get("donate", False),
                  donate_grads=flags.get("donate_grads", False))
    return {"form": name, "bytes_per_param": got.bytes_per_param,
            "path": "fused" if got.fast else "pure", "reason": got.traffic_reason}


def _laid_out_lion() -> dict[str, Any]:
    """Lion compiled after ``step.lay_out``: params and gradients in one buffer each."""
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    tx = functopt.lion(1e-4)
    step = make_step(tx, compile=True, donate=True)
    params = step.lay_out(dict(model.named_parameters()))
    state = step.init(params)
    sum(m(torch.randn(2, 256)).sum() for m in model).backward()
    grads = {k: p.grad for k, p in params.items()}
    got = explain(tx, params, state, grads, compile=True, donate=True)
    return {"form": "lion, make_step(compile=True, donate=True) after step.lay_out",
            "bytes_per_param": got.bytes_per_param, "path": "fused",
            "reason": got.traffic_reason}


def _mixed(name: str, step: Any, params: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``explain``'s count for a mixed-precision step (bfloat16 params)."""
    params = step.lay_out({k: p.bfloat16() for k, p in params.items()})
    got = step.explain(params, step.init(params))
    return {"form": name, "bytes_per_param": got.bytes_per_param,
            "path": "fused" if got.fast else "pure", "reason": got.traffic_reason}


def _on_an_accelerator(row: Any) -> dict[str, Any]:
    """A row counted with the compiled mixed step's path off the CPU (it reads the bf16
    gradients itself; ``functopt/fast/_compiled.py``, ``READ_GIVEN_ON_CPU``)."""
    from functopt.fast import _compiled

    before = _compiled.READ_GIVEN_ON_CPU
    _compiled.READ_GIVEN_ON_CPU = True
    try:
        return dict(row())
    finally:
        _compiled.READ_GIVEN_ON_CPU = before


def _torch_idiom(params: dict[str, torch.Tensor]) -> dict[str, Any]:
    """PyTorch's mixed-precision idiom over bfloat16 params, counted over one real step:
    float32 masters with float32 main grads (the bfloat16 gradients cast into them),
    ``clip_grad_norm_``, ``AdamW(fused=True)`` on the masters, the masters copied into the
    params."""
    low = [p.bfloat16() for p in params.values()]
    masters = [torch.nn.Parameter(p.float()) for p in low]
    opt = torch.optim.AdamW(masters, 1e-3, fused=True)
    grads = [torch.randn_like(p) for p in low]

    def step() -> None:
        for m, g in zip(masters, grads, strict=True):
            if m.grad is None:
                m.grad = torch.empty_like(m)
            m.grad.copy_(g)
        torch.nn.utils.clip_grad_norm_(masters, 1.0)
        opt.step()
        with torch.no_grad():
            torch._foreach_copy_(low, masters)

    for _ in range(2):
        step()
    with torch.no_grad():
        got = _traffic._counted(step)
    assert not isinstance(got, str), got
    return {"form": "PyTorch's idiom: f32 main grads, clip_grad_norm_, AdamW(fused), copy",
            "bytes_per_param": got.total / sum(p.numel() for p in low), "path": "torch",
            "reason": None}


def _torch(name: str, make: Any, clip: float | None, params: dict[str, torch.Tensor],
           ) -> dict[str, Any]:
    """The same count over one real step of a torch.optim optimizer (after two steps, so
    that its state exists), with ``clip_grad_norm_`` first when ``clip`` is set."""
    ps = [torch.nn.Parameter(p.clone()) for p in params.values()]
    opt = make(ps)

    def step() -> None:
        for p in ps:
            p.grad = torch.randn_like(p) * 10
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ps, clip)
        opt.step()

    for _ in range(2):
        step()
    for p in ps:
        p.grad = torch.randn_like(p) * 10
    grads = [p.grad for p in ps]

    def counted_step() -> None:
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ps, clip)
        opt.step()

    with torch.no_grad():
        got = _traffic._counted(counted_step)
    assert not isinstance(got, str), got
    elements = sum(g.numel() for g in grads)
    return {"form": name, "bytes_per_param": got.total / elements, "path": "torch",
            "reason": None}


def rows() -> list[dict[str, Any]]:
    """Every form's bytes per param per step."""
    params = _tree((256, 256), 8)
    clip_adamw = functopt.chain(functopt.clip_by_global_norm(1.0), functopt.adamw(1e-3))
    out = [
        _functopt("chain(clip_by_global_norm(1), adamw), make_step(donate=True)",
                  clip_adamw, params, donate=True),
        _functopt("the same, donate_grads=True", clip_adamw, params, donate=True,
                  donate_grads=True),
        _functopt("the same, make_step() (no donation)", clip_adamw, params),
        _torch("clip_grad_norm_ + torch.optim.AdamW(fused=True)",
               lambda ps: torch.optim.AdamW(ps, 1e-3, fused=True), 1.0, params),
        _functopt("adamw, make_step(donate=True)", functopt.adamw(1e-3), params, donate=True),
        _torch("torch.optim.AdamW(fused=True)",
               lambda ps: torch.optim.AdamW(ps, 1e-3, fused=True), None, params),
        _torch("torch.optim.AdamW(foreach=True)",
               lambda ps: torch.optim.AdamW(ps, 1e-3, foreach=True), None, params),
        _functopt("lion, make_step(donate=True) (pure path)", functopt.lion(1e-4), params,
                  donate=True),
        _functopt("lion, make_step(compile=True, donate=True), separate tensors",
                  functopt.lion(1e-4), params, compile=True, donate=True),
        _laid_out_lion(),
        _functopt("contrib.muon, make_step(donate=True), 8 matrices 512x512",
                  contrib.muon(0.02), _tree((512, 512), 8), donate=True),
        _functopt("contrib.muon(ns_dtype=torch.bfloat16), the same",
                  contrib.muon(0.02, ns_dtype=torch.bfloat16), _tree((512, 512), 8),
                  donate=True),
        _torch("torch.optim.Muon, 8 matrices 512x512",
               lambda ps: torch.optim.Muon(ps, 0.02), None, _tree((512, 512), 8)),
        _mixed("mixed_precision(adamw, max_grad_norm=1, donate=True), bf16 params",
               mixed_precision(functopt.adamw(1e-3), max_grad_norm=1.0, donate=True),
               params),
        _mixed("the same, no max_grad_norm",
               mixed_precision(functopt.adamw(1e-3), donate=True), params),
        _mixed("the same, not donated",
               mixed_precision(functopt.adamw(1e-3)), params),
        _mixed("mixed_precision(adamw, compile=True, donate=True) after lay_out, CPU",
               mixed_precision(functopt.adamw(1e-3), compile=True, donate=True), params),
        _on_an_accelerator(lambda: _mixed(
            "the same on an accelerator (the call reads the bf16 gradients itself)",
            mixed_precision(functopt.adamw(1e-3), compile=True, donate=True), params)),
        _torch_idiom(params),
        _functopt("adafactor, make_step(donate=True)", functopt.adafactor(1e-3), params,
                  donate=True),
        _torch("torch.optim.Adafactor(foreach=False)",
               lambda ps: torch.optim.Adafactor(ps, 1e-2), None, params),
    ]
    for row in out:
        per = row["bytes_per_param"]
        row["h200_ms_at_10M"] = None if per is None else per * PARAMS / H200_BYTES_PER_S * 1e3
    return out


def case(cfg: dict[str, Any], args: Any) -> dict[str, Any]:
    """``benchmarks/run.py --only traffic``: print the table; the check is that every form
    was counted."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", functopt.fast.FastPathWarning)
        table = rows()
    print("\n== traffic: bytes read and written per param per step (counted, not timed)")
    print(f"  {'form':<78} {'B/param':>8} {'ms at 10M, 4.8 TB/s':>20}")
    for row in table:
        per, ms = row["bytes_per_param"], row["h200_ms_at_10M"]
        shown = "not counted" if per is None else f"{per:8.1f}"
        print(f"  {row['form']:<78} {shown:>8} {'' if ms is None else f'{ms:20.3f}'}")
    passed = all(row["bytes_per_param"] is not None for row in table)
    return {"rows": table, "check": {"passed": passed}}


if __name__ == "__main__":
    sys.exit(0 if case({}, None)["check"]["passed"] else 1)
