"""HF Trainer drives functopt's optimizers (issue 10 item 5): a tiny GPT-2 built from a
config (nothing downloaded) trained with a plain functopt recipe and with
``functopt.optim.AdamW``, under the Trainer's own learning-rate scheduler, checkpointed and
resumed bitwise. The reference is the same run with ``torch.optim.AdamW``.
"""

from __future__ import annotations

import pytest
import torch

import functopt

transformers = pytest.importorskip("transformers")

STEPS, SAVE_AT = 6, 3


def _model():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                     n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def _data():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (24, 8), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def _args(out, **kw):
    return transformers.TrainingArguments(
        output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=4, learning_rate=5e-3,
        weight_decay=1e-2, lr_scheduler_type="cosine", warmup_steps=2, save_strategy="steps",
        save_steps=SAVE_AT, logging_strategy="no", report_to=[], use_cpu=True, seed=0,
        data_seed=0, dataloader_num_workers=0, disable_tqdm=True, **kw)


def _train(out, make_opt=None, cls_kwargs=None, resume=None):
    model = _model()
    extra = {} if cls_kwargs is None else {"optimizer_cls_and_kwargs": cls_kwargs}
    optimizers = (None, None) if make_opt is None else (make_opt(model), None)
    trainer = transformers.Trainer(model=model, args=_args(out), train_dataset=_data(),
                                   optimizers=optimizers, **extra)
    trainer.train(resume_from_checkpoint=resume)
    return model, trainer


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("kind", ["recipe", "optim.AdamW"])
def test_hf_trainer_trains_checkpoints_and_resumes_bitwise(tmp_path, kind):
    if kind == "recipe":  # a plain recipe, handed to the Trainer built
        def make(model):
            return functopt.Optimizer(model.parameters(), functopt.adamw(5e-3, weight_decay=1e-2))

        def make_ref(model):
            return torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=1e-2)
        run, ref_run = {"make_opt": make}, {"make_opt": make_ref}
    else:  # the Trainer builds it, with its decay / no-decay groups (weight_decay set)
        run = {"cls_kwargs": (functopt.optim.AdamW, {"lr": 5e-3})}
        ref_run = {"cls_kwargs": (torch.optim.AdamW, {"lr": 5e-3})}
    model, trainer = _train(tmp_path / "a", **run)
    straight = _params(model)
    # The Trainer's cosine schedule with warm-up drove the group's lr (to 0 at the end).
    assert trainer.optimizer.param_groups[0]["lr"] == 0.0
    assert trainer.lr_scheduler.get_last_lr()[0] == 0.0
    # torch.optim.AdamW in the same Trainer: the same training (to float32 rounding).
    ref, _ = _train(tmp_path / "ref", **ref_run)
    diff = max((p - q).abs().max().item() for p, q in zip(straight, _params(ref), strict=True))
    assert diff < 1e-5, diff
    moved = max((p - q).abs().max().item() for p, q in zip(straight, _params(_model()),
                                                           strict=True))
    assert moved > 1e-3  # it did train
    # Resume from the step-3 checkpoint (optimizer.pt, scheduler.pt): bitwise the same end.
    resumed, _ = _train(tmp_path / "a", resume=str(tmp_path / "a" / f"checkpoint-{SAVE_AT}"),
                        **run)
    assert all(torch.equal(p, q) for p, q in zip(_params(resumed), straight, strict=True))
