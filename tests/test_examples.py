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


def test_demo_trains(demo_run: tuple[str, Path]) -> None:
    stdout, _ = demo_run
    assert int(number(r"steps:\s+(\d+)", stdout)) == 60  # --quick
    first = number(r"first loss:\s+([\d.]+)", stdout)
    last = number(r"last loss:\s+([\d.]+)", stdout)
    test_loss = number(r"test loss:\s+([\d.]+)", stdout)
    baseline = number(r"predicting the mean:\s+([\d.]+)", stdout)
    assert last < 0.8 * first, stdout
    assert test_loss < baseline, stdout  # it learned something that generalises
    assert number(r"params:\s+([\d,]+)", stdout) == 2 * 64 + 64 + 64 * 64 + 64 + 64 + 1


def test_demo_writes_loss_plot(demo_run: tuple[str, Path]) -> None:
    stdout, out = demo_run
    png = out / "demo_loss.png"
    assert str(png) in stdout
    width, height = png_size(png)
    assert width >= 400 and height >= 200


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
