"""``save_rank_checkpoint`` / ``load_rank_checkpoint``: per-rank files that a save killed
part way cannot tear (one process here; two gloo ranks below; the torchrun example of
Megatron-style TP x PP kills a rank mid-save: tests/test_example_megatron_tp_pp.py)."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import harness

from functopt import load_rank_checkpoint, save_rank_checkpoint


def test_the_newest_complete_checkpoint_loads(tmp_path: Path) -> None:
    for step in (3, 6):
        save_rank_checkpoint({"step": torch.tensor(step)}, tmp_path, step)
    assert load_rank_checkpoint(tmp_path)[0] == 6
    # a save of step 9 killed before its completion record: its file is there, no record
    folder = tmp_path / "step-000000009"
    folder.mkdir()
    torch.save({"step": torch.tensor(9)}, folder / "rank-00000-of-00001.pt")
    step, obj = load_rank_checkpoint(tmp_path)
    assert step == 6 and int(obj["step"]) == 6


def test_only_keep_complete_checkpoints_are_left(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        save_rank_checkpoint({"w": torch.ones(1) * step}, tmp_path, step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000003", "step-000000004"]


def test_what_does_not_belong_together_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        load_rank_checkpoint(tmp_path)
    value = torch.full((4,), 1234.5)
    folder = save_rank_checkpoint({"w": value}, tmp_path, 5)
    record = json.loads((folder / "COMPLETE.json").read_text())
    assert record == {"step": 5, "world": 1}
    (folder / "COMPLETE.json").write_text(json.dumps({"step": 5, "world": 2}))
    with pytest.raises(ValueError, match="saved by 2 ranks, this group has 1"):
        load_rank_checkpoint(tmp_path)
    (folder / "COMPLETE.json").write_text(json.dumps(record))
    path = folder / "rank-00000-of-00001.pt"
    data = bytearray(path.read_bytes())
    at = bytes(data).index(value.numpy().tobytes())  # a byte of the tensor's data
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="cannot be loaded on every rank"):
        load_rank_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        save_rank_checkpoint({}, tmp_path, -1)


def _two_ranks(rank: int, world: int, folder: str) -> dict[str, object]:
    out: dict[str, object] = {}
    save_rank_checkpoint({"mine": torch.tensor(float(rank))}, folder, 3)
    step, obj = load_rank_checkpoint(folder)
    out["loaded"] = (step, float(obj["mine"]))
    # a save of step 6 where rank 1's file never came: rank 0 wrote, no record
    if rank == 0:
        os.makedirs(Path(folder) / "step-000000006")
        torch.save({"mine": torch.tensor(60.0)},
                   Path(folder) / "step-000000006" / "rank-00000-of-00002.pt")
    dist.barrier()
    step, obj = load_rank_checkpoint(folder)
    out["after torn save"] = (step, float(obj["mine"]))
    # a complete checkpoint one of whose files is lost afterwards: every rank raises
    save_rank_checkpoint({"mine": torch.tensor(9.0)}, folder, 9)
    if rank == 1:
        os.remove(Path(folder) / "step-000000009" / "rank-00001-of-00002.pt")
    dist.barrier()
    try:
        load_rank_checkpoint(folder)
        out["lost file"] = "loaded"
    except ValueError as e:
        out["lost file"] = str(e)
    return out


def test_two_ranks_load_one_step_or_raise_together(tmp_path: Path) -> None:
    results = harness.run_ranks(functools.partial(_two_ranks, folder=str(tmp_path)), 2)
    for rank, got in enumerate(results):
        assert got["loaded"] == (3, float(rank))
        assert got["after torn save"] == (3, float(rank))
        assert "cannot be loaded on every rank" in str(got["lost file"]), got
