"""Research optimizers with optax.contrib's names, signatures, defaults and semantics.

An optax port changes the import: ``optax.contrib.muon(0.02)`` becomes
``functopt.contrib.muon(0.02)``. Each optimizer is held equal to optax.contrib in float64
over 20 steps (tests/test_contrib.py, against values recorded with optax 0.2.8) and runs
the conformance suite. Transforms (``scale_by_*``) and recipes (chains of them) follow the
conventions of the rest of functopt: per-leaf maths in the widest of the leaf's dtypes and
float32, ``None`` gradients leave their state untouched, counters are 0-d int32 tensors.

Examples:
    >>> import torch, functopt
    >>> from functopt import contrib
    >>> opt = contrib.adopt(1e-2)
    >>> params = {"w": torch.ones(3)}
    >>> state = opt.init(params)
    >>> updates, state = opt.update({"w": torch.ones(3)}, state, params)
    >>> functopt.apply_updates(params, updates)  # ADOPT's first step only records g^2
    {'w': tensor([1., 1., 1.])}
"""

from functopt.contrib._ademamix import (
    ScaleByAdemamixState,
    ScaleBySimplifiedAdEMAMixState,
    ademamix,
    scale_by_ademamix,
    scale_by_simplified_ademamix,
    simplified_ademamix,
)
from functopt.contrib._adopt import adopt, scale_by_adopt
from functopt.contrib._madgrad import MadgradState, madgrad, scale_by_madgrad
from functopt.contrib._muon import MuonDimensionNumbers, MuonState, muon, scale_by_muon
from functopt.contrib._prodigy import DAdaptAdamWState, ProdigyState, dadapt_adamw, prodigy
from functopt.contrib._schedule_free import (
    ScheduleFreeState,
    schedule_free,
    schedule_free_adamw,
    schedule_free_eval_params,
    schedule_free_sgd,
)

__all__ = [
    "DAdaptAdamWState",
    "MadgradState",
    "MuonDimensionNumbers",
    "MuonState",
    "ProdigyState",
    "ScaleByAdemamixState",
    "ScaleBySimplifiedAdEMAMixState",
    "ScheduleFreeState",
    "ademamix",
    "adopt",
    "dadapt_adamw",
    "madgrad",
    "muon",
    "prodigy",
    "scale_by_ademamix",
    "scale_by_adopt",
    "scale_by_madgrad",
    "scale_by_muon",
    "scale_by_simplified_ademamix",
    "schedule_free",
    "schedule_free_adamw",
    "schedule_free_eval_params",
    "schedule_free_sgd",
    "simplified_ademamix",
]
