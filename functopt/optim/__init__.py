"""Drop-in replacements for ``torch.optim``'s optimizers, built on functopt chains.

Change ``torch.optim.AdamW`` to ``functopt.optim.AdamW``: each class has torch's name,
signature, defaults and numerics (held equal to torch.optim in float64 on every
configuration of torch's own optimizer test database, and rejecting its constructor error
inputs with the same exception types), and is a ``torch.optim.Optimizer`` (a
[`functopt.Optimizer`][functopt.Optimizer]) that runs a functopt chain: ``opt.transform``
is that chain, for inspection (``functopt.fast.explain``) or for use on its own. Adam,
AdamW and SGD take PyTorch's fused kernels; Muon runs on the per-leaf tier (the iteration
batched over same-shape matrices; [`muon_split`][functopt.optim.muon_split] splits a model
as Muon's authors do); the others, torch's Adafactor among them, run the pure per-leaf
chain.

Examples:
    >>> import torch, functopt
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = functopt.optim.AdamW(model.parameters(), lr=1e-3)
    >>> isinstance(opt, torch.optim.Optimizer)
    True
    >>> model(torch.randn(3, 4)).sum().backward()
    >>> opt.step()
    >>> sorted(opt.param_groups[0])[:4]
    ['amsgrad', 'betas', 'capturable', 'decoupled_weight_decay']
"""

from functopt.optim._adafactor import Adafactor
from functopt.optim._adam import Adam, Adamax, AdamW, NAdam, RAdam
from functopt.optim._muon import Muon, muon_split
from functopt.optim._sgd import SGD, Adadelta, Adagrad, RMSprop, Rprop

__all__ = [
    "SGD",
    "Adadelta",
    "Adafactor",
    "Adagrad",
    "Adam",
    "AdamW",
    "Adamax",
    "Muon",
    "NAdam",
    "RAdam",
    "RMSprop",
    "Rprop",
    "muon_split",
]
