"""Generate tests/golden/contrib_optax.json: optax.contrib trajectories in float64.

Run by hand, never by the test suite (it needs optax and jax, which the project does not
pin)::

    python3 -m venv /tmp/optaxenv && /tmp/optaxenv/bin/pip install optax
    /tmp/optaxenv/bin/python tests/golden/make_contrib_golden.py

Every configuration runs 20 steps on a small float64 tree (a non-square 2-D leaf ``w``, a
3-D leaf ``k`` for Muon's dimension numbers, a 1-D ``b`` and a 0-d ``s``) with a fixed
gradient sequence (stored in the file, so the test needs no random generator of numpy's).
Schedules take dyadic values (exact in float32): optax's schedules return float32 even
with x64 enabled, so other values would carry float32 rounding into the float64 reference.
The file stores each step's updates (and, for schedule-free, the evaluation params); the
test applies them in float64 exactly as here (``p + u``).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import optax.contrib as oc  # noqa: E402

STEPS = 20
SHAPES = {"w": (4, 3), "k": (2, 3, 2), "b": (3,), "s": ()}
OUT = Path(__file__).with_name("contrib_optax.json")

rng = np.random.default_rng(20261201)
PARAMS0 = {k: rng.normal(size=shape) for k, shape in SHAPES.items()}
# A fixed direction plus noise: the iterates drift, so the distance estimates of Prodigy and
# D-Adaptation grow within 20 steps (with zero-mean noise they would stay at estim_lr0).
MEAN = {k: rng.normal(size=shape) for k, shape in SHAPES.items()}
GRADS = [{k: MEAN[k] + 0.5 * rng.normal(size=shape) for k, shape in SHAPES.items()}
         for _ in range(STEPS)]

DN = oc.MuonDimensionNumbers

# name -> (keys of the tree, factory, functopt-side description of the same call).
# The "call" entry is what the test rebuilds: factory name, positional-free keyword args;
# schedules are written as {"schedule": name, ...} and built by both sides alike.
def sched(spec):
    if isinstance(spec, dict) and "schedule" in spec:
        kw = {k: v for k, v in spec.items() if k != "schedule"}
        return getattr(optax, spec["schedule"])(**kw)
    return spec


CONFIGS = {
    "muon_default": (["w", "b", "s"], "muon", {"learning_rate": 0.02}),
    "muon_dimnums_spectral": (["w", "k", "b", "s"], "muon", {
        "learning_rate": 0.02, "nesterov": False, "weight_decay": 0.1,
        "weight_decay_mask": {"w": True, "k": False, "b": True, "s": True},
        "adaptive": True, "preconditioning": "spectral", "consistent_rms": 0.2,
        "adam_learning_rate": 0.01, "adam_weight_decay": 0.05, "adam_b1": 0.8,
        "adam_b2": 0.99, "beta": 0.9, "eps": 1e-7,
        "muon_weight_dimension_numbers": {
            "w": "DN(0, 1)", "k": "DN(1, 2)", "b": None, "s": None},
    }),
    "muon_aol_dion": (["w", "k", "b", "s"], "muon", {
        "learning_rate": 0.05, "preconditioning": "aol", "ns_coeffs": "dion",
        "muon_weight_dimension_numbers": {
            "w": "DN(1, 0)", "k": "DN((0, 1), 2)", "b": None, "s": None},
    }),
    "muon_schatten_3coeffs": (["w", "b", "s"], "muon", {
        "learning_rate": 0.05, "preconditioning": "schatten",
        "ns_coeffs": [[4.0848, -6.8946, 2.9270], [3.9505, -6.3029, 2.6377],
                      [3.7418, -5.5913, 2.3037]],
    }),
    "scale_by_muon_lr": (["w"], "scale_by_muon", {
        "beta": 0.9, "ns_steps": 4, "weight_dimension_numbers": {"w": "DN(0, 1)"}}),
    "schedule_free_adamw": (["w", "b", "s"], "schedule_free_adamw", {
        "learning_rate": 0.125, "warmup_steps": 4, "weight_decay": 0.01}),
    "schedule_free_adamw_default": (["w", "b", "s"], "schedule_free_adamw", {}),
    "schedule_free_sgd": (["w", "b", "s"], "schedule_free_sgd", {
        "learning_rate": 0.1, "b1": 0.8, "weight_decay": 0.01, "weight_lr_power": 1.0}),
    "schedule_free_sgd_default": (["w", "b", "s"], "schedule_free_sgd", {"warmup_steps": 4}),
    "schedule_free_adam_b1_0": (["w", "b", "s"], "schedule_free", {
        "base_optimizer": {"optimizer": "adam", "learning_rate": 0.05, "b1": 0.0},
        "learning_rate": 0.05, "b1": 0.95}),
    "adopt_default": (["w", "b", "s"], "adopt", {"learning_rate": 0.01}),
    "adopt_nesterov_noclip": (["w", "b", "s"], "adopt", {
        "learning_rate": 0.01, "b1": 0.8, "b2": 0.99, "eps": 1e-5, "nesterov": True,
        "use_clipping": False}),
    "ademamix_default": (["w", "b", "s"], "ademamix", {"learning_rate": 0.01}),
    "ademamix_schedules": (["w", "b", "s"], "ademamix", {
        "learning_rate": 0.01, "b1": 0.8, "b2": 0.99, "eps_root": 1e-8,
        "b3": {"schedule": "linear_schedule", "init_value": 0.875, "end_value": 0.9921875,
               "transition_steps": 8},
        "alpha": {"schedule": "linear_schedule", "init_value": 0.0, "end_value": 8.0,
                  "transition_steps": 8},
        "weight_decay": 0.1, "mask": {"w": True, "b": False, "s": True}}),
    "scale_by_ademamix": (["w", "b", "s"], "scale_by_ademamix", {}),
    "simplified_ademamix_default": (["w", "b", "s"], "simplified_ademamix", {
        "learning_rate": 0.01}),
    "simplified_ademamix_alpha": (["w", "b", "s"], "simplified_ademamix", {
        "learning_rate": 0.01, "b1": 0.9, "b2": 0.9, "alpha": 2.0, "eps_root": 1e-8,
        "weight_decay": 0.1, "mask": {"w": True, "b": False, "s": True}}),
    "prodigy_default": (["w", "b", "s"], "prodigy", {}),
    "prodigy_options": (["w", "b", "s"], "prodigy", {
        "learning_rate": {"schedule": "linear_schedule", "init_value": 1.0,
                          "end_value": 0.5, "transition_steps": 16},
        "betas": [0.8, 0.99], "beta3": 0.9, "eps": 1e-6, "estim_lr0": 1e-3,
        "estim_lr_coef": 0.5, "weight_decay": 0.01, "safeguard_warmup": True}),
    "dadapt_adamw_default": (["w", "b", "s"], "dadapt_adamw", {}),
    "dadapt_adamw_options": (["w", "b", "s"], "dadapt_adamw", {
        "learning_rate": {"schedule": "linear_schedule", "init_value": 1.0,
                          "end_value": 0.5, "transition_steps": 16},
        "betas": [0.8, 0.99], "eps": 1e-6, "estim_lr0": 1e-3, "weight_decay": 0.01}),
    "madgrad_default": (["w", "b", "s"], "madgrad", {"learning_rate": 0.01}),
    "madgrad_options": (["w", "b", "s"], "madgrad", {
        "learning_rate": {"schedule": "linear_schedule", "init_value": 0.0625,
                          "end_value": 0.03125, "transition_steps": 16},
        "momentum": 0.5, "weight_decay": 0.01, "eps": 1e-4}),
    "scale_by_madgrad": (["w", "b", "s"], "scale_by_madgrad", {"learning_rate": 0.01}),
}


def build_kwargs(kwargs):
    out = {}
    for key, value in kwargs.items():
        if key in ("muon_weight_dimension_numbers", "weight_dimension_numbers"):
            value = {k: None if v is None else eval(v, {"DN": DN}) for k, v in value.items()}
        elif key == "base_optimizer":
            spec = dict(value)
            value = getattr(optax, spec.pop("optimizer"))(**spec)
        elif key in ("betas",):
            value = tuple(value)
        elif key == "ns_coeffs" and isinstance(value, list):
            value = tuple(tuple(row) for row in value)
        else:
            value = sched(value)
        out[key] = value
    return out


def run(keys, factory, kwargs):
    tx = getattr(oc, factory)(**build_kwargs(kwargs))
    params = {k: jnp.asarray(PARAMS0[k]) for k in keys}
    state = tx.init(params)
    updates_per_step, eval_per_step = [], []
    for t in range(STEPS):
        grads = {k: jnp.asarray(GRADS[t][k]) for k in keys}
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        updates_per_step.append({k: np.asarray(updates[k]).tolist() for k in keys})
        if factory.startswith("schedule_free"):
            ev = oc.schedule_free_eval_params(state, params)
            eval_per_step.append({k: np.asarray(ev[k]).tolist() for k in keys})
        for k in keys:
            assert updates[k].dtype == jnp.float64, (factory, k, updates[k].dtype)
    out = {"keys": keys, "factory": factory, "kwargs": kwargs, "updates": updates_per_step}
    if eval_per_step:
        out["eval_params"] = eval_per_step
    return out


def signatures():
    names = ["muon", "scale_by_muon", "schedule_free", "schedule_free_adamw",
             "schedule_free_sgd", "schedule_free_eval_params", "adopt", "scale_by_adopt",
             "ademamix", "scale_by_ademamix", "simplified_ademamix",
             "scale_by_simplified_ademamix", "prodigy", "dadapt_adamw", "madgrad",
             "scale_by_madgrad"]
    out = {}
    for name in names:
        sig = inspect.signature(getattr(oc, name))
        out[name] = [
            [p.name, p.kind.name,
             None if p.default is inspect.Parameter.empty else
             (p.default if isinstance(p.default, (int, float, str, bool, type(None)))
              else list(p.default) if isinstance(p.default, tuple) else repr(p.default))]
            for p in sig.parameters.values()
        ]
    return out


def main():
    golden = {
        "optax_version": optax.__version__,
        "jax_version": jax.__version__,
        "steps": STEPS,
        "params0": {k: v.tolist() for k, v in PARAMS0.items()},
        "grads": [{k: v.tolist() for k, v in g.items()} for g in GRADS],
        "signatures": signatures(),
        "configs": {name: run(*spec) for name, spec in CONFIGS.items()},
    }
    OUT.write_text(json.dumps(golden, separators=(",", ":")) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes), optax {optax.__version__}")


if __name__ == "__main__":
    main()
