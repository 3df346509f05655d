"""examples/fsdp_tp_train.py under torchrun: FSDP2 x TP on 4 CPU ranks (gloo), a checkpoint
saved there and resumed on 2 ranks, continuing as the uninterrupted run."""

from __future__ import annotations

import re
from pathlib import Path

from distributed import harness

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fsdp_tp_train.py"


def torchrun(ranks: int, *args: str) -> str:
    return harness.torchrun(EXAMPLE, ranks, "--quick", *args)


def test_fsdp_tp_saved_on_4_resumed_on_2(tmp_path: Path) -> None:
    first = torchrun(4, "--dir", str(tmp_path))
    assert "world 4 (gloo, cpu), mesh (dp 2, tp 2)" in first, first
    # every param is a DTensor on the 2-D mesh: FSDP's Shard(0) over dp, TP's over tp
    # (a row-parallel bias Replicate over tp)
    assert "(Shard(dim=0), Replicate())" in first and "(Shard(dim=0), Shard(dim=1))" in first
    assert "saved a checkpoint after step 3 on 4 ranks" in first, first
    assert "collectives per optimizer step: 1\n" in first, first  # the packed all-reduce
    assert len(re.findall(r"^step +\d+ ", first, flags=re.M)) == 8, first  # rank 0 alone
    assert "(Shard(dim=0),)" in first, first  # the LayerNorms: on the dp sub-mesh alone
    assert ("verdict: one collective per optimizer step, the norm counts each element once: "
            "True") in first, first
    # the LayerNorms left out of the TP plan, declared replicated, are counted once: the
    # norm is the gathered gradients' (counted once per TP rank it would be far off)
    norms = re.search(r"global gradient norm [0-9.]+, of the gathered gradients [0-9.]+: "
                      r"relative difference ([0-9.e+-]+)", first)
    assert norms and float(norms.group(1)) <= 1e-5, first

    second = torchrun(2, "--dir", str(tmp_path), "--resume")
    assert "world 2 (gloo, cpu), mesh (dp 1, tp 2)" in second, second
    assert ("resumed at step 4 on 2 ranks from the checkpoint of 4 ranks: master weights "
            "bitwise the saved ones: True") in second, second
    assert "collectives per optimizer step: 1\n" in second, second
    norms = re.search(r"global gradient norm [0-9.]+, of the gathered gradients [0-9.]+: "
                      r"relative difference ([0-9.e+-]+)", second)
    assert norms and float(norms.group(1)) <= 1e-5, second
    assert [int(s) for s in re.findall(r"^step +(\d+) ", second, flags=re.M)] == [4, 5, 6, 7]
    verdict = re.search(r"loss max relative difference ([0-9.e+-]+) \(within ([0-9.e+-]+): "
                        r"(\w+)\); final master weights: difference norm [0-9.e+-]+, "
                        r"([0-9.]+) of their move since the checkpoint \([0-9.e+-]+; within "
                        r"([0-9.]+): (\w+)\)", second)
    assert verdict, second
    assert float(verdict.group(1)) <= float(verdict.group(2)) == 1e-3, second
    assert float(verdict.group(4)) <= float(verdict.group(5)) == 0.1, second
    assert verdict.group(3) == verdict.group(6) == "True"
    assert ("verdict: resumed on 2 ranks bitwise and continues as the uninterrupted run: True"
            in second), second
    # the losses of the resumed steps, printed by both runs, agree to the stated tolerance
    losses = [{int(s): float(v) for s, v in re.findall(r"^step +(\d+) +loss ([0-9.]+)", out,
                                                        flags=re.M)} for out in (first, second)]
    for step, loss in losses[1].items():
        assert abs(loss - losses[0][step]) <= 1e-3 * losses[0][step], (step, losses)
