"""examples/megatron_tp_pp.py under torchrun: Megatron-style TP x PP on 4 CPU ranks (gloo),
plain tensors, the facade with Megatron's groups; a nan on one rank's shard skips every
rank; a rank killed mid-save; the run resumed from the checkpoint before, its losses the
uninterrupted run's; the same model data-parallel x TP, with the TP x PP run's losses."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from distributed import harness

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "megatron_tp_pp.py"


def _losses(out: str) -> dict[int, str]:
    return {int(s): v for s, v in re.findall(r"^step +(\d+) +loss ([0-9.]+)", out, flags=re.M)}


def test_killed_mid_save_resumes_from_the_checkpoint_before(tmp_path: Path) -> None:
    first = harness.torchrun(EXAMPLE, 4, "--dir", str(tmp_path / "a"), timeout_s=180.0)
    assert "verdict: a nan on rank 3's shard skipped the step on every rank: True" in first
    assert re.search(r"^step +2 .* skipped +loss scale 2048$", first, flags=re.M), first
    assert ("verdict: the norm over every stage is the hand count's, each element once"
            in first and first.count(": True") == 2), first
    assert "saved a checkpoint after step 6 on 4 ranks" in first, first

    killed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "4", str(EXAMPLE), "--dir", str(tmp_path / "b"), "--kill-at", "6"],
        cwd=EXAMPLE.parents[1], capture_output=True, text=True, timeout=180, check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert killed.returncode != 0, killed.stdout
    assert "saved a checkpoint after step 3 on 4 ranks" in killed.stdout
    assert "saved a checkpoint after step 6" not in killed.stdout
    torn = tmp_path / "b" / "step-000000006"
    assert torn.is_dir() and not (torn / "COMPLETE.json").exists()
    assert not (torn / "rank-00001-of-00004.pt").exists()  # the killed rank's

    resumed = harness.torchrun(EXAMPLE, 4, "--dir", str(tmp_path / "b"), "--resume",
                               str(tmp_path / "a"), timeout_s=180.0)
    assert "resumed after step 3, the newest complete checkpoint" in resumed, resumed
    assert "verdict: losses of steps 4-7 equal the uninterrupted run's: True" in resumed
    ours, theirs = _losses(resumed), _losses(first)
    assert sorted(ours) == [4, 5, 6, 7]
    assert all(theirs[k] == v for k, v in ours.items()), (ours, theirs)

    # the same model in the data-parallel x TP layout, against the uninterrupted run
    dp_tp = harness.torchrun(EXAMPLE, 4, "--dir", str(tmp_path / "d"), "--layout", "dp-tp",
                             "--compare", str(tmp_path / "a"), timeout_s=180.0)
    assert "verdict: a nan on rank 3's shard skipped the step on every rank: True" in dp_tp
    assert "verdict: the norm over every stage is the hand count's" in dp_tp, dp_tp
    assert "verdict: losses equal the TP x PP run's within 0.002" in dp_tp, dp_tp
    assert dp_tp.count(": True") == 3, dp_tp
    assert sorted(_losses(dp_tp)) == list(range(8))
