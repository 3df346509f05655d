"""torch.optim.Muon as a functopt chain."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from functopt.adapters._torch_state import TorchLayout
from functopt.optim import _base, _chains

__all__ = ["Muon", "muon_split"]

_ADJUSTMENTS = (None, "original", "match_rms_adamw")


class Muon(_base.TorchOptimizer):
    r"""``torch.optim.Muon`` as a functopt chain: the same signature, defaults and numerics.

    Each param is a matrix stored ``(out, in)``, as ``torch.nn.Linear`` stores its weight.
    With $B_t = \mu B_{t-1} + (1-\mu) g_t$ (no bias correction) and
    $\tilde B_t = \mu B_t + (1-\mu) g_t$ with ``nesterov`` ($B_t$ without), the step is
    $\theta \leftarrow \theta(1 - \gamma\lambda) - \gamma_{\text{adj}}\,
    \mathrm{NS}(\tilde B_t)$: ``ns_steps`` Newton-Schulz steps with ``ns_coefficients``
    after dividing by $\max(\lVert \tilde B_t\rVert_F, \epsilon)$, in bfloat16 as torch
    iterates, and $\gamma_{\text{adj}} = \gamma\sqrt{\max(1, \text{out}/\text{in})}$
    (``adjust_lr_fn`` None or "original", Keller Jordan's) or
    $0.2\,\gamma\sqrt{\max(\text{out}, \text{in})}$ ("match_rms_adamw", Moonshot's, which
    reuses AdamW's learning rate and weight decay). The chain is
    ``chain(contrib.scale_by_muon(bias_correction=False, clamp_norm=True,
    weight_dimension_numbers=MuonDimensionNumbers(1, 0), ns_dtype=torch.bfloat16),
    shape factor, [add_decayed_weights], scale_by_learning_rate)`` under
    ``inject_hyperparams``; it runs on the planner's per-leaf tier (the momentum as
    ``foreach`` ops, the iteration batched over same-shape matrices).

    ``lr``, ``weight_decay`` and ``momentum`` live in ``param_groups`` (schedulers move
    them; a ``weight_decay`` of 0 in the constructor and every group has no stage); a group
    may set its own ``nesterov``, ``ns_coefficients``, ``eps``, ``ns_steps`` and
    ``adjust_lr_fn`` (it runs its own chain). The state dict is torch's (``momentum_buffer`` per param, no
    ``step``): it loads into ``torch.optim.Muon``, and torch's loads here.

    ``ns_dtype`` (keyword only, not in torch's signature) is the dtype of the iteration:
    None iterates in the momentum's dtype (float32 or wider), slower where bfloat16 matrix
    products are fast and exact to the param's precision, and the faster one on a CPU
    without bfloat16 matrix instructions (AVX2-only x86), where PyTorch's bfloat16 products
    are several times slower than its float32 ones.

    Muon is for the hidden layers' matrices; its authors update embeddings, output heads,
    biases and gains with AdamW. [`muon_split`][functopt.optim.muon_split] makes that split
    in one line::

        hidden, rest = functopt.optim.muon_split(model)
        opts = [functopt.optim.Muon(hidden, lr=0.02), functopt.optim.AdamW(rest, lr=3e-4)]

    ([`contrib.muon`][functopt.contrib.muon] is the same split as one transform, with
    optax's ``(in, out)`` reading of matrices by default.)

    Examples:
        >>> import torch, functopt
        >>> g = torch.tensor([[3.0, 0.0], [0.0, 0.5], [1.0, 1.0]])
        >>> w, t = torch.nn.Parameter(torch.eye(3, 2)), torch.nn.Parameter(torch.eye(3, 2))
        >>> opt, ref = functopt.optim.Muon([w], lr=0.1), torch.optim.Muon([t], lr=0.1)
        >>> w.grad, t.grad = g.clone(), g.clone()
        >>> opt.step()
        >>> ref.step()
        >>> bool((w - t).abs().max() < 1e-6)
        True
    """

    _differentiable_key = False
    _sparse_words = "Muon does not support sparse gradients"
    _complex_words = "Muon does not support complex parameters"
    _torch_layout = TorchLayout({"momentum_buffer": ("MuonState.mu",)}, step=False,
                                constants=frozenset({"MuonState.ns_coeffs"}))

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
        eps: float = 1e-07,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        ns_dtype: torch.dtype | None = torch.bfloat16,
        compile: bool = False,
    ) -> None:
        owner = "functopt.optim.Muon"
        _base.check_options(owner, nesterov=nesterov)
        _base.check_lr(owner, lr)
        _base.check_nonnegative(owner, weight_decay=weight_decay, eps=eps)
        mu = _base.number(owner, "momentum", momentum)
        _base.check(owner, 0.0 <= mu, f"momentum should be >= 0 but is: {momentum}",
                    "momentum >= 0")
        _base.check(owner, mu < 1.0, f"momentum should be < 1 but is: {momentum}",
                    "0 <= momentum < 1: the momentum is an average of the gradients")
        if adjust_lr_fn not in _ADJUSTMENTS:
            raise ValueError(f"{owner}: Adjust learning rate function {adjust_lr_fn} is not "
                             f"supported (expected one of {list(_ADJUSTMENTS)}).")
        if (not isinstance(ns_coefficients, (tuple, list)) or len(ns_coefficients) != 3
                or not all(isinstance(c, (int, float)) for c in ns_coefficients)):
            raise ValueError(f"{owner}: ns_coefficients must be a tuple of exactly 3 numbers "
                             f"(a, b, c), got {ns_coefficients!r}.")
        if not isinstance(ns_steps, int) or isinstance(ns_steps, bool) or not 1 <= ns_steps < 100:
            raise ValueError(f"{owner}: ns_steps must be an int in [1, 100), got "
                             f"{ns_steps!r}. Fix: 5 is usual.")
        params = _base.listed(params)
        hyper: dict[str, Any] = {"learning_rate": lr, "momentum": momentum}
        fixed: dict[str, Any] = {"nesterov": nesterov, "ns_coefficients": ns_coefficients,
                                 "eps": eps, "ns_steps": ns_steps,
                                 "adjust_lr_fn": adjust_lr_fn}
        values = [weight_decay, *_base.groups_set(params, "weight_decay")]
        if any(_base.number(owner, "weight_decay", v) != 0 for v in values):
            hyper["weight_decay"] = weight_decay
        else:
            fixed["weight_decay"] = weight_decay
        flags = {"nesterov": nesterov, "ns_coefficients": tuple(map(float, ns_coefficients)),
                 "eps": float(eps), "ns_steps": ns_steps, "adjust_lr_fn": adjust_lr_fn,
                 "ns_dtype": ns_dtype}
        super().__init__(params, _chains.muon, hyper, flags, fixed, lowerable=True,
                         fused=None, differentiable=False, compile=compile)
        for i, group in enumerate(self.param_groups):
            _check_matrices(owner, i, group["params"])

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """``torch.optim.Optimizer.add_param_group``; every param must be a matrix."""
        super().add_param_group(param_group)
        try:
            _check_matrices("functopt.optim.Muon.add_param_group",
                            len(self.param_groups) - 1, self.param_groups[-1]["params"])
        except ValueError:
            self.param_groups.pop()
            raise


def _check_matrices(owner: str, index: int, params: list[torch.Tensor]) -> None:
    for j, p in enumerate(params):
        if p.ndim != 2:
            raise ValueError(
                f"{owner}: Muon only supports 2D parameters whereas we found a parameter with "
                f"size: {p.size()} (param {j} of group {index}). Fix: update biases, gains, "
                f"embeddings and heads with another optimizer (functopt.optim.AdamW), as "
                f"Muon's authors do."
            )


def muon_split(model: torch.nn.Module, *, heads: Sequence[str] = ("lm_head",),
               ) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """The params of ``model`` split as Muon's authors split them: ``(hidden, rest)``.

    ``hidden`` holds the 2-D weights of every module that is not a ``torch.nn.Embedding``
    and whose qualified name contains none of ``heads`` (the output layers, found by name:
    ``("lm_head",)`` for Hugging Face's causal language models; pass the names your model
    gives its heads); ``rest`` holds every other param (embeddings, heads, biases, gains,
    convolution kernels), for AdamW. Each param is in exactly one list, once (a head tied to
    the embedding is the embedding's), in ``model.parameters()`` order.

    Examples:
        >>> import torch, functopt
        >>> model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4),
        ...                             torch.nn.LayerNorm(4))
        >>> hidden, rest = functopt.optim.muon_split(model)
        >>> [tuple(p.shape) for p in hidden], [tuple(p.shape) for p in rest]
        ([(4, 4)], [(10, 4), (4,), (4,), (4,)])
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"functopt.optim.muon_split: model must be a torch.nn.Module, got "
                        f"{type(model).__name__}. Fix: pass the model; for a list of params, "
                        f"choose the matrices for Muon yourself.")
    if isinstance(heads, str) or not all(isinstance(h, str) for h in heads):
        raise TypeError(f"functopt.optim.muon_split: heads must be a sequence of name "
                        f"fragments, got {heads!r}. Fix: heads=({heads!r},) for one name.")
    embedded = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding)
                for p in m.parameters()}
    hidden: list[torch.nn.Parameter] = []
    rest: list[torch.nn.Parameter] = []
    for name, p in model.named_parameters():
        module = name.rpartition(".")[0]
        matrix = (p.ndim == 2 and id(p) not in embedded
                  and not any(h in module for h in heads))
        (hidden if matrix else rest).append(p)
    return hidden, rest
