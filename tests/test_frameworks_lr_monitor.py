"""Lightning's ``LearningRateMonitor`` on functopt's optimizers.

The monitor reads ``param_groups[i]["lr"]`` (and ``betas[0]``, ``weight_decay``) at every
step. ``functopt.Optimizer`` with a plain recipe and ``MixedPrecisionOptimizer`` (from a
torch optimizer, and with a plain recipe) must log what ``torch.optim.AdamW`` logs under the
same scheduler: the reference is torch's own optimizer in the same trainer, and StepLR's
rule ``lr * gamma ** (step // step_size)``.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import functopt

pl = pytest.importorskip("pytorch_lightning")

_STEPS = 6
_LR, _GAMMA, _EVERY = 1e-2, 0.5, 2


class _Memory(pl.loggers.Logger):
    """A logger that keeps the logged metrics."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append(dict(metrics))


class _Net(pl.LightningModule):
    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(3, 1)
        self.kind = kind

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        return self.net(batch).pow(2).mean()

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        params = self.net.named_parameters()
        if self.kind == "torch":
            opt: torch.optim.Optimizer = torch.optim.AdamW(
                [p for _, p in params], lr=_LR, weight_decay=0.1)
        elif self.kind == "functopt":
            opt = functopt.Optimizer(params, functopt.adamw(_LR, weight_decay=0.1))
        elif self.kind == "facade-recipe":  # a plain recipe: its values in the groups too
            opt = functopt.MixedPrecisionOptimizer(
                params, functopt.adamw(_LR, weight_decay=0.1), loss_scale=None)
        else:
            opt = functopt.MixedPrecisionOptimizer(
                torch.optim.AdamW([p for _, p in params], lr=_LR, weight_decay=0.1),
                loss_scale=None)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=_EVERY, gamma=_GAMMA)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _logged(kind: str, tmp_path) -> dict[str, list[float]]:  # type: ignore[no-untyped-def]
    logger = _Memory()
    monitor = pl.callbacks.LearningRateMonitor(logging_interval="step", log_momentum=True,
                                               log_weight_decay=True)
    trainer = pl.Trainer(max_steps=_STEPS, accelerator="cpu", devices=1, logger=logger,
                         callbacks=[monitor], log_every_n_steps=1, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False,
                         default_root_dir=tmp_path)
    data = torch.utils.data.DataLoader(torch.randn(_STEPS, 4, 3), batch_size=None)
    with warnings.catch_warnings():
        # Lightning's advice on loaders, and its own use of a deprecated torch pytree API
        for message in ("The '.*dataloader' does not have many workers",
                        r"`isinstance\(treespec, LeafSpec\)` is deprecated"):
            warnings.filterwarnings("ignore", message=message)
        trainer.fit(_Net(kind), data)
    series: dict[str, list[float]] = {}
    for row in logger.rows:
        for key, value in row.items():
            if key.startswith("lr-"):  # 'lr-AdamW-momentum' -> 'momentum'
                series.setdefault(key.split("-", 2)[2] if key.count("-") > 1 else "lr",
                                  []).append(float(value))
    return series


@pytest.mark.parametrize("kind", ["functopt", "facade", "facade-recipe"])
def test_learning_rate_monitor_logs_the_schedulers_values(kind: str, tmp_path) -> None:
    ours, reference = _logged(kind, tmp_path / kind), _logged("torch", tmp_path / "torch")
    expected = [_LR * _GAMMA ** (t // _EVERY) for t in range(_STEPS)]
    assert reference["lr"] == pytest.approx(expected, rel=1e-12)
    assert ours == reference  # lr, momentum (betas[0]) and weight_decay at every step
    assert set(ours) == {"lr", "momentum", "weight_decay"}
