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

import functopt

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


# -- the examples of the guide (docs/examples.md) ------------------------------------------


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"functopt_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_meta_learning_rate_learns_the_learning_rate() -> None:
    stdout = run_example("meta_learning_rate.py", "--quick").stdout
    assert "verdict: validation loss improved: True; meta-gradient matches finite differences: " \
           "True" in stdout, stdout
    rows = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)$", stdout, re.MULTILINE)
    steps = [int(r[0]) for r in rows]
    lrs = [float(r[1]) for r in rows]
    val = [float(r[2]) for r in rows]
    assert steps[0] == 0 and steps[-1] == 30 and steps == sorted(steps), stdout  # --quick: 30
    assert lrs[0] == 0.001 and lrs[-1] > 5 * lrs[0], stdout  # 1e-3 was far too small
    assert val[-1] < 0.5 * val[0], stdout
    # The printed summary is the table's first and last rows.
    assert f"validation loss: {val[0]:.6f} -> {val[-1]:.6f}" in stdout
    autograd = number(r"autograd (\S+),", stdout)
    finite_diff = number(r"finite differences (\S+),", stdout)
    assert autograd < 0 and autograd == pytest.approx(finite_diff, rel=1e-6)  # raise the lr
    assert number(r"relative error ([\d.e+-]+)", stdout) < 1e-6


def test_vmap_ensemble_equals_a_loop() -> None:
    stdout = run_example("vmap_ensemble.py", "--quick").stdout
    assert "verdict: every member trained: True; vmap equals the loop: True" in stdout, stdout
    rows = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)$", stdout, re.MULTILINE)
    assert [int(r[0]) for r in rows] == list(range(8)), stdout  # --quick: 8 members
    assert all(float(last) < 0.5 * float(first) for _, first, last in rows), stdout
    assert len({first for _, first, _ in rows}) == 8  # different inits and data per member
    assert number(r"max abs difference of the params ([\d.e+-]+)", stdout) < 1e-4
    vmap_s = number(r"time: vmap ([\d.]+) s", stdout)
    loop_s = number(r"loop ([\d.]+) s", stdout)
    ratio = number(r"speed ratio ([\d.]+)x", stdout)
    assert vmap_s > 0 and loop_s > 0
    assert ratio == pytest.approx(loop_s / vmap_s, abs=0.1 + 0.01 * ratio)  # printed, not made up


def test_port_optax_maps_and_trains() -> None:
    stdout = run_example("port_optax.py", "--quick").stdout
    for optax_name in ("optax.chain", "optax.clip_by_global_norm", "optax.scale_by_adam",
                       "optax.add_decayed_weights", "optax.scale_by_learning_rate"):
        assert re.search(rf"{optax_name}\s+-> functopt\.{optax_name[6:]}$", stdout, re.MULTILINE)
    assert re.search(r"optax\.warmup_cosine_decay_schedule\s+-> "
                     r"functopt\.schedules\.warmup_cosine_decay_schedule", stdout)
    assert "decay mask: {'0.weight': True, '0.bias': False, '2.weight': True, '2.bias': False}" \
           in stdout
    assert "learning rate by step: 0: 0.0000, 10: 0.0150, 20: 0.0300," in stdout  # warmup
    assert "149: 0.0010" in stdout  # the end value
    assert "Adam step count in the state: 150" in stdout
    first = number(r"loss: ([\d.]+) ->", stdout)
    last = number(r"loss: [\d.]+ -> ([\d.]+)", stdout)
    assert last < 0.5 * first and number(r"training accuracy ([\d.]+)%", stdout) > 90
    assert "verdict: the port trains: True" in stdout


def test_port_optax_lookup_fails_on_a_missing_name() -> None:
    lookup = load_example("port_optax").lookup
    assert lookup("functopt.schedules.warmup_cosine_decay_schedule") is \
        functopt.schedules.warmup_cosine_decay_schedule
    with pytest.raises(AttributeError, match="scale_by_nothing"):
        lookup("functopt.scale_by_nothing")


def test_replace_torch_optim_curves_agree() -> None:
    stdout = run_example("replace_torch_optim.py", "--quick").stdout
    assert "verdict: the loss curves agree: True; the model trained: True" in stdout, stdout
    curves = re.findall(r"^  ([ABC]) .* loss ([\d.]+) -> ([\d.]+), max \|diff\| from A (\S+)$",
                        stdout, re.MULTILINE)
    assert [c[0] for c in curves] == ["A", "B", "C"], stdout
    assert float(curves[0][3]) == 0.0
    assert all(float(c[3]) < 1e-5 for c in curves), stdout
    assert len({c[1] for c in curves}) == 1  # the same start
    assert float(curves[0][2]) < 0.5 * float(curves[0][1])
    assert number(r"max difference ([\d.e+-]+)", stdout) == max(float(c[3]) for c in curves)
    assert "+ functopt.Optimizer(model.parameters(), functopt.inject_hyperparams(" in stdout


def test_fast_step_is_bitwise_torch_fused() -> None:
    stdout = run_example("fast_step.py", "--quick").stdout
    assert "verdict: fast path bitwise equal to torch: True; pure path agrees: True" in stdout
    assert "params bitwise equal after every step: True" in stdout
    assert "updated the module's own parameters in place: True" in stdout
    rows = re.findall(r"^  (torch fused|functopt fast|functopt pure) +([\d.]+) ms/step",
                      stdout, re.MULTILINE)
    assert [r[0] for r in rows] == ["torch fused", "functopt fast", "functopt pure"], stdout
    assert all(float(ms) > 0 for _, ms in rows)
    drift = number(r"of the params' largest move \(([\d.e+-]+)\)", stdout)
    assert drift > 0 and number(r"max \|diff\| ([\d.e+-]+),", stdout) < 1e-2 * drift


def test_contrib_compare_trains_every_optimizer_and_plots(tmp_path: Path) -> None:
    stdout = run_example("contrib_compare.py", "--quick", "--out", str(tmp_path)).stdout
    assert int(number(r"steps:\s+(\d+)", stdout)) == 60
    rows = re.findall(r"^(\w+) +first loss ([\d.]+)  last loss ([\d.]+)", stdout, re.MULTILINE)
    names = [r[0] for r in rows]
    assert names == ["adamw", "muon", "schedule_free_adamw", "adopt", "ademamix", "prodigy",
                     "dadapt_adamw", "madgrad"], stdout
    assert len({r[1] for r in rows}) == 1  # one start for all
    assert all(float(last) < 0.5 * float(first) for _, first, last in rows), stdout
    assert "muon orthogonalises the 3 matrices" in stdout
    assert "verdict: every optimizer halved the loss: True" in stdout
    png = tmp_path / "contrib_compare.png"
    assert str(png) in stdout
    assert png_size(png) == (800, 500)
