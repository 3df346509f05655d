"""The examples run end to end (quick mode) and do what they print."""

from __future__ import annotations

import importlib.util
import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run_example(name: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, f"{name} failed:\n{result.stdout}\n{result.stderr}"
    return result


def png_size(path: Path) -> tuple[int, int]:
    """Width and height of a PNG, after checking its signature and every chunk's CRC."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG (signature {data[:8]!r})"
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"bad CRC in chunk {kind!r} of {path}"
        chunks.append(kind)
        pos += 12 + length
    assert chunks[0] == b"IHDR" and chunks[-1] == b"IEND" and b"IDAT" in chunks, chunks
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def number(pattern: str, text: str) -> float:
    match = re.search(pattern, text)
    assert match, f"no match for {pattern!r} in:\n{text}"
    return float(match.group(1).replace(",", ""))


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp("demo")
    return run_example("demo.py", "--quick", "--out", str(out)).stdout, out


QUICK_INJECTED = [24, 42]  # 40% and 70% of the 60 quick steps
NUM_PARAMS = 2 * 64 + 64 + 64 * 64 + 64 + 64 + 1


def test_demo_trains(demo_run: tuple[str, Path]) -> None:
    stdout, _ = demo_run
    assert int(number(r"steps:\s+(\d+)", stdout)) == 60  # --quick
    first = number(r"first loss:\s+([\d.]+)", stdout)
    last = number(r"last loss:\s+([\d.]+)", stdout)
    test_loss = number(r"test loss:\s+([\d.]+)", stdout)
    baseline = number(r"predicting the mean:\s+([\d.]+)", stdout)
    assert last < 0.8 * first, stdout
    assert test_loss < baseline, stdout  # it learned something that generalises
    assert number(r"params:\s+([\d,]+)", stdout) == NUM_PARAMS
    assert "in 6 tensors, torch.bfloat16" in stdout


def test_demo_reports_the_skipped_steps(demo_run: tuple[str, Path]) -> None:
    stdout, _ = demo_run
    assert f"injected at steps {QUICK_INJECTED}" in stdout
    assert f"skipped steps:   2 {QUICK_INJECTED} (the state counts 2)" in stdout
    for step in QUICK_INJECTED:
        assert re.search(rf"step {step}: injected overflow .* params unchanged bitwise: True", stdout)
    # PyTorch's rule halves the scale on each overflow; with growth_interval=50 and an overflow
    # at step 24 (which restarts the count), 60 steps never grow it: 1024 -> 512 -> 256.
    assert "loss scale 1024 -> 512" in stdout and "loss scale 512 -> 256" in stdout
    assert re.search(r"loss scale:\s+1024 -> 256 ", stdout), stdout


def test_demo_master_weights_are_exact(demo_run: tuple[str, Path]) -> None:
    stdout, _ = demo_run
    assert f"exact master:    True (bf16 param == float32 master rounded to bfloat16, bitwise, " \
           f"for {NUM_PARAMS:,} of {NUM_PARAMS:,} elements)" in stdout
    # float32 master (4) + AdamW mu and nu (4 + 4) + a few 0-d scalars, per param.
    bytes_per_param = number(r"state bytes:\s+([\d.]+) per param", stdout)
    assert 12.0 < bytes_per_param < 12.1, stdout
    assert number(r"float32 master ([\d.]+)", stdout) == 4.0


def test_demo_exactness_check_can_fail() -> None:
    """The printed exactness line is computed: a master off by one float32 ulp is caught."""
    demo = load_demo()
    p = torch.tensor([1.0, -0.5, 3.0], dtype=torch.bfloat16)
    master = p.float()
    assert demo.exactness({"w": p}, {"w": master}) == (3, 3)
    # 1 + 2**-8 + 2**-23 rounds up to the next bfloat16 (1 + 2**-7), not to the param 1.0.
    master_off = master.clone()
    master_off[0] = 1.0 + 2.0**-8 + 2.0**-23
    assert demo.exactness({"w": p}, {"w": master_off}) == (2, 3)


def test_demo_writes_loss_plot(demo_run: tuple[str, Path]) -> None:
    stdout, out = demo_run
    png = out / "demo_loss.png"
    assert str(png) in stdout
    width, height = png_size(png)
    assert width >= 400 and height >= 500  # two panels: loss and loss scale


def load_demo() -> ModuleType:
    spec = importlib.util.spec_from_file_location("functopt_demo", EXAMPLES / "demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_steps_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    load_demo().main(["--steps", "3", "--out", str(tmp_path)])
    stdout = capsys.readouterr().out
    assert int(number(r"steps:\s+(\d+)", stdout)) == 3
    assert "injected at steps none" in stdout  # too short a run to show a recovery
    assert "skipped steps:   0 []" in stdout
    assert png_size(tmp_path / "demo_loss.png")[0] > 0


def test_demo_rejects_bad_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        load_demo().main(["--steps", "0", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "--steps must be at least 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "demo_loss.png").exists()


def test_quickstart_converges() -> None:
    stdout = run_example("quickstart.py").stdout
    first = number(r"step +1: loss ([\d.]+)", stdout)
    last = number(r"step 200: loss ([\d.]+)", stdout)
    assert first > 10 and last < 1e-4, stdout
    values = [float(v) for v in re.search(r"step 200: .*w = \[(.*)\]", stdout).group(1).split(",")]
    assert values == pytest.approx([1.0, -2.0, 3.0], abs=1e-3)
    assert "step count in the state: 200" in stdout
