"""MixedPrecisionOptimizer in the training frameworks: Lightning, accelerate, HF Trainer.

Lightning: ``configure_optimizers`` returns the facade with a torch scheduler, in automatic
optimization (bf16-mixed autocast) and in a manual loop (the facade's own bfloat16 masters),
``global_step`` advancing and a resume from checkpoint continuing bitwise. accelerate:
``prepare`` and a ``save_state`` / ``load_state`` round trip continuing bitwise. HF Trainer:
a tiny GPT-2 built from a config (no download) trained with the facade and its scheduler
passed as ``optimizers=``, resumed from a checkpoint bitwise.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import functopt

pl = pytest.importorskip("pytorch_lightning")
accelerate = pytest.importorskip("accelerate")


def _batches(n: int = 12) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(n, 4, 3, generator=g)
    return [(x, x.sum(1, keepdim=True).sin()) for x in xs]


class _Net(pl.LightningModule):
    def __init__(self, dtype: torch.dtype, manual: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(),
                                       torch.nn.Linear(8, 1)).to(dtype)
        self.automatic_optimization = not manual
        self.took: list[bool] = []

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        # The data follow the step count: a resumed run restarts its (plain) loader's epoch.
        x, y = _batches()[self.global_step]
        loss = (self.net(x.to(next(self.parameters()).dtype)).float() - y).pow(2).mean()
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.optimizer.backward(loss)  # the facade's scaled backward
        opt.step()
        opt.zero_grad()
        self.lr_schedulers().step()
        return loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        opt = functopt.MixedPrecisionOptimizer(
            torch.optim.AdamW(self.net.parameters(), lr=1e-2),
            loss_scale=None if self.automatic_optimization else functopt.dynamic_loss_scale())
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _trainer(tmp_path, steps: int, precision: str) -> pl.Trainer:
    return pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, precision=precision,
                      logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, default_root_dir=tmp_path)


def _fit(module, trainer, ckpt_path=None):  # type: ignore[no-untyped-def]
    loader = torch.utils.data.DataLoader(_batches(), batch_size=None)
    with warnings.catch_warnings():
        # Lightning's advice, not about the optimizer: loader workers, logging a step
        # without a logger, a mid-epoch resume of a plain loader (the data follow the step
        # count here), and its own use of a deprecated torch pytree API.
        for message in ("The '.*dataloader' does not have many workers",
                        "You called `self.log",
                        "You're resuming from a checkpoint that ended before the epoch",
                        r"`isinstance\(treespec, LeafSpec\)` is deprecated"):
            warnings.filterwarnings("ignore", message=message)
        trainer.fit(module, loader, ckpt_path=ckpt_path)


@pytest.mark.parametrize(("manual", "dtype", "precision"), [
    (False, torch.float32, "bf16-mixed"),  # Lightning's autocast, the facade unscaled
    (True, torch.bfloat16, "32-true"),  # the facade's own bfloat16 masters, manual loop
])
def test_lightning_trains_steps_schedules_and_resumes_bitwise(tmp_path, manual, dtype,
                                                              precision) -> None:
    straight = _Net(dtype, manual)
    trainer = _trainer(tmp_path, 8, precision)
    _fit(straight, trainer)
    assert trainer.global_step == 8
    opt = trainer.optimizers[0]
    assert isinstance(opt, functopt.MixedPrecisionOptimizer)
    assert opt.param_groups[0]["lr"] == 1e-2 * 0.5 ** 2  # StepLR moved it twice (8 steps)

    first = _Net(dtype, manual)
    trainer = _trainer(tmp_path, 5, precision)
    _fit(first, trainer)
    trainer.save_checkpoint(tmp_path / "five.ckpt")
    resumed = _Net(dtype, manual)
    trainer = _trainer(tmp_path, 8, precision)
    _fit(resumed, trainer, ckpt_path=tmp_path / "five.ckpt")
    assert trainer.global_step == 8
    for p, q in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)
    changed = any(not torch.equal(p, q) for p, q in zip(straight.parameters(),
                                                          _Net(dtype, manual).parameters(),
                                                          strict=True))
    assert changed


def test_accelerate_prepare_save_state_load_state_continue_bitwise(tmp_path) -> None:
    from accelerate import Accelerator

    def setup():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(),
                                    torch.nn.Linear(8, 1)).to(torch.bfloat16)
        opt = functopt.MixedPrecisionOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-2), loss_scale=None)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))
        acc = Accelerator(cpu=True)
        return (acc, *acc.prepare(model, opt, sched))

    def train(acc, model, opt, sched, batches):  # type: ignore[no-untyped-def]
        for x, y in batches:
            acc.backward((model(x.to(torch.bfloat16)).float() - y).pow(2).mean())
            opt.step()
            sched.step()
            opt.zero_grad()

    batches = _batches(8)
    acc, model, opt, sched = setup()
    assert isinstance(opt.optimizer, functopt.MixedPrecisionOptimizer)
    train(acc, model, opt, sched, batches[:4])
    acc.save_state(str(tmp_path / "state"))
    reference = copy.deepcopy(model)
    train(acc, model, opt, sched, batches[4:])

    acc2, model2, opt2, sched2 = setup()
    acc2.load_state(str(tmp_path / "state"))
    assert all(torch.equal(p, q) for p, q in zip(model2.parameters(), reference.parameters(),
                                                 strict=True))
    assert opt2.param_groups[0]["lr"] == 1e-2 * (1.0 / 5)  # LambdaLR after 4 steps
    train(acc2, model2, opt2, sched2, batches[4:])
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters(),
                                                 strict=True))


@pytest.mark.parametrize("kind", ["torch.optim.AdamW", "recipe"])
def test_hf_trainer_trains_a_tiny_gpt2_with_the_facade_and_resumes_bitwise(tmp_path,
                                                                           kind) -> None:
    """The facade from a torch optimizer, and over a plain recipe (whose lr is in the
    groups, where HF Trainer's scheduler writes it)."""
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids}
            for ids in torch.randint(0, 64, (16, 12), generator=g)]

    def run(out, resume=None):  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16,
                                           n_layer=1, n_head=2, bos_token_id=0,
                                           eos_token_id=0)).to(torch.bfloat16)
        if kind == "recipe":
            opt = functopt.MixedPrecisionOptimizer(
                model.parameters(), functopt.adamw(1e-3, weight_decay=0.01), loss_scale=None)
        else:
            opt = functopt.MixedPrecisionOptimizer(
                torch.optim.AdamW(model.parameters(), lr=1e-3), loss_scale=None)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))
        args = TrainingArguments(
            output_dir=str(out), max_steps=6, per_device_train_batch_size=4, save_steps=3,
            save_strategy="steps", report_to=[], use_cpu=True, logging_strategy="no",
            seed=0, disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, sched))
        trainer.train(resume_from_checkpoint=resume)
        return model, opt, trainer

    model, opt, trainer = run(tmp_path / "a")
    assert trainer.state.global_step == 6 and opt.param_groups[0]["lr"] == 1e-3 * (1.0 / 7)
    master = opt._state.master
    assert all(torch.equal(p, master[str(i)].to(torch.bfloat16))
               for i, p in enumerate(model.parameters()))
    resumed, _, _ = run(tmp_path / "b", resume=str(tmp_path / "a" / "checkpoint-3"))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), resumed.parameters(),
                                                 strict=True))
    fresh = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1,
                                       n_head=2))
    assert not torch.equal(fresh.transformer.wte.weight.to(torch.bfloat16),
                           model.transformer.wte.weight)
