"""examples/fsdp2_train.py runs under torchrun on 2 CPU ranks (gloo) and does what it prints."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 60


def test_fsdp2_example_quick() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(ROOT / "examples" / "fsdp2_train.py"), "--quick"],
        cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S, check=False, env=env,
    )
    out = result.stdout
    assert result.returncode == 0, f"fsdp2_train.py failed:\n{out}\n{result.stderr}"
    assert "world 2 (gloo, cpu)" in out, out
    loss = re.search(r"loss ([0-9.]+) -> ([0-9.]+) \(decreased: (\w+)\)", out)
    assert loss and loss.group(3) == "True", out
    assert float(loss.group(2)) < 0.5 * float(loss.group(1)), out
    assert "collectives per optimizer step: 1\n" in out, out
    exact = re.search(r"max relative difference ([0-9.e+-]+) \(within 1e-6: (\w+)\); ranks "
                      r"agree on the global norm: (\w+)", out)
    assert exact and exact.group(2) == "True" and exact.group(3) == "True", out
    assert float(exact.group(1)) <= 1e-6
    # rank 0 alone prints the progress
    assert len(re.findall(r"^step +0 ", out, flags=re.M)) == 1, out
