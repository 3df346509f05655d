"""The benchmark harness runs, measures something, and checks that the contenders agree.

Nothing here asserts on speed: the numbers depend on the machine and its load. What is
asserted is that every case reports positive finite timings and that each benchmarked
computation was checked against the others (a benchmark of a wrong computation is
worthless), that a "functopt fused" contender really took the fused path, and that the
checks and the memory method can fail when they should. Memory is counted exactly (the
profiler's allocator events do not depend on load), so the fused paths' step memory is
asserted against torch's.
"""

from __future__ import annotations

import importlib
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import functopt

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
CASES = {"adamw", "mixed", "chains", "mixed_chains", "small", "leaves", "size", "memory",
         "compile", "engine", "bandwidth", "traffic", "optim"}
ADAMW_NAMES = {"functopt pure", "functopt fused", "torch foreach", "torch fused"}
MIXED_NAMES = {"functopt pure", "functopt fused", "torch idiom"}
COMPILE_NAMES = {"functopt compiled", "functopt compiled, lay_out",
                 "functopt pure", "torch fused"}
# the adamw case also times the torch.optim.Optimizer adapter
ADAMW_CASE_NAMES = ADAMW_NAMES | {"functopt.Optimizer"}


def _bench_module(name: str) -> Any:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


def _timings(report: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Every per-contender timing summary in the report, with a label."""
    found = []
    cases = report["cases"]
    for case in ("adamw", "mixed", "compile"):
        found += [(f"{case}/{n}", t) for n, t in cases[case]["timings"].items()]
    for case in ("leaves", "size"):
        for point in cases[case]["points"]:
            found += [(f"{case}/{point['leaves']}/{point['params']}/{n}", t)
                      for n, t in point["timings"].items()]
    found += [(f"bandwidth/{k}", cases["bandwidth"]["streams"][k])
              for k in ("add_out", "add_inplace", "add_fresh")]
    return found


def _positive_finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    out = tmp_path_factory.mktemp("bench") / "quick.json"
    # One thread: the test machine is shared, and two OpenMP threads on two busy cores
    # make the run slow without making the check any stronger.
    proc = subprocess.run(
        [sys.executable, str(BENCH / "run.py"), "--quick", "--repeats", "2", "--threads", "1",
         "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=False,
    )
    assert proc.returncode == 0, f"run.py failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(out.read_text()), proc.stdout


def test_quick_run_reports_the_composed_chains(quick_report):
    """Issue 9's cases: every composed chain and every way of writing the mixed step is
    timed beside its PyTorch counterpart, and checked against functopt's pure path (the
    donated fast contenders would report a lost fast path as a failed check)."""
    report, _ = quick_report
    cases = report["cases"]
    assert set(cases["chains"]["subcases"]) == {"clip_adamw", "masked_decay",
                                                "adam_decay_schedule", "lion"}
    assert set(cases["mixed_chains"]["subcases"]) == {"max_grad_norm", "chain_clip",
                                                      "facade_1_group", "facade_2_groups"}
    assert set(cases["small"]["subcases"]) == {"adamw", "mixed"}
    for case in ("chains", "mixed_chains", "small"):
        assert cases[case]["check"]["passed"], case
        for name, sub in cases[case]["subcases"].items():
            assert sub["check"]["passed"], (case, name, sub["check"])
            assert all(_positive_finite(t["median_s"]) for t in sub["timings"].values())
    for name, sub in {**cases["chains"]["subcases"],
                      **cases["mixed_chains"]["subcases"]}.items():
        assert _positive_finite(sub["ratio"]), name
    assert cases["chains"]["subcases"]["clip_adamw"]["ratio_of"] == \
        "functopt fused/torch fused"
    assert "torch fused AdamW" in cases["chains"]["subcases"]["lion"]["timings"]


def test_quick_run_times_the_program_engine_beside_todays_step(quick_report):
    """The engine case: the program engine's eager step, make_step(donate=True) and the pure
    path side by side on the clip chain, checked equal (the engine's step a donated one:
    a lost path would be a failed check)."""
    report, _ = quick_report
    engine = report["cases"]["engine"]
    assert engine["check"]["passed"], engine["check"]
    assert set(engine["timings"]) == {"functopt pure", "functopt fused",
                                      "functopt program (eager)", "torch fused"}
    for key in ("functopt program (eager)/functopt fused",
                "functopt program (eager)/functopt pure"):
        assert _positive_finite(engine["ratios"][key]), key


def test_quick_run_counts_every_forms_traffic(quick_report):
    """The traffic case: every form counted (bytes per param positive and finite), the
    implied time at 10M params consistent with the count, and the orderings the counts
    exist to show: donating the gradients saves the kernel's gradient copy, and laying
    Lion out for the compiled tier moves fewer bytes than separate tensors."""
    report, stdout = quick_report
    traffic = report["cases"]["traffic"]
    assert traffic["check"]["passed"]
    rows = {r["form"]: r for r in traffic["rows"]}
    for form, r in rows.items():
        assert _positive_finite(r["bytes_per_param"]), form
        assert abs(r["h200_ms_at_10M"] - r["bytes_per_param"] * 1e7 / 4.8e12 * 1e3) < 1e-9
        assert form in stdout
    readme = rows["chain(clip_by_global_norm(1), adamw), make_step(donate=True)"]
    assert rows["the same, donate_grads=True"]["bytes_per_param"] < readme["bytes_per_param"]
    assert (rows["lion, make_step(compile=True, donate=True) after step.lay_out"]
            ["bytes_per_param"]
            < rows["lion, make_step(compile=True, donate=True), separate tensors"]
            ["bytes_per_param"])


def test_quick_run_reports_every_case_with_positive_finite_timings(quick_report):
    report, stdout = quick_report
    assert set(report["cases"]) == CASES
    assert report["config"]["quick"] is True and report["config"]["repeats"] == 2
    assert report["config"]["threads"] == 1
    timings = _timings(report)
    # adamw 5, mixed 3, compile 4, leaves 4 points x 3, size 4 x 1, bandwidth 3
    assert len(timings) == 5 + 3 + 4 + 4 * 3 + 4 * 1 + 3
    for label, t in timings:
        # Bandwidth takes at least 3 samples whatever --repeats says (it is cheap).
        assert len(t["samples_s"]) == (3 if label.startswith("bandwidth") else 2), label
        for key in ("median_s", "min_s", "q25_s", "q75_s", *t["samples_s"]):
            value = t[key] if isinstance(key, str) else key
            assert _positive_finite(value), f"{label}: {key} = {value!r}"
        assert t["q25_s"] <= t["median_s"] <= t["q75_s"], label
    for case, names in (("adamw", ADAMW_CASE_NAMES), ("mixed", MIXED_NAMES),
                        ("compile", COMPILE_NAMES), ("leaves", ADAMW_NAMES),
                        ("size", ADAMW_NAMES)):
        points = report["cases"][case].get("points", [report["cases"][case]])
        for p in points:
            assert set(p["timings"]) == names, case
            assert p["steps_per_block"] >= 1 and p["params"] > 0
            assert all(_positive_finite(r) for r in p["ratios"].values())
    for case in ("adamw", "leaves", "size"):
        for p in report["cases"][case].get("points", [report["cases"][case]]):
            adapter = {"functopt.Optimizer/torch fused"} if case == "adamw" else set()
            assert set(p["ratios"]) == {"functopt fused/torch fused",
                                        "functopt pure/torch fused",
                                        "torch foreach/torch fused"} | adapter, case
    assert set(report["cases"]["mixed"]["ratios"]) == {"functopt fused/torch idiom",
                                                       "functopt pure/torch idiom"}
    for p in report["cases"]["leaves"]["points"]:
        assert set(p["us_per_leaf"]) == ADAMW_NAMES
        assert all(_positive_finite(x) for x in p["us_per_leaf"].values())
    assert [p["leaves"] for p in report["cases"]["leaves"]["points"]] == [10, 100, 1000]
    assert "machine" in report and report["machine"]["torch"] == torch.__version__
    for key in ("cpu", "logical_cores", "date_utc", "torch_threads"):
        assert report["machine"][key], key
    assert "cpu:" in stdout and "torch_threads:" in stdout


def test_quick_run_checks_the_contenders_computed_the_same_result(quick_report):
    report, stdout = quick_report
    assert report["checks_passed"] is True
    cases = report["cases"]
    for case in ("adamw", "mixed", "compile"):
        check = cases[case]["check"]
        assert check["passed"] is True and check["problems"] == []
        assert check["steps"] >= 2 + 1 + 2  # warm-up, calibration, two timed rounds
        # every contender but the reference is checked; the compile case's torch fused
        # AdamW is a yardstick beside Lion, timed only
        yardsticks = {"torch fused"} if case == "compile" else set()
        names = set(cases[case]["timings"]) - {check["reference"]} - yardsticks
        assert set(check["max_abs_diff"]) == names
        assert all(0 <= d <= 1e-4 for d in check["max_abs_diff"].values())
    for case in ("leaves", "size"):
        assert cases[case]["check"]["passed"] is True
        assert all(p["check"]["passed"] for p in cases[case]["points"])
    assert cases["memory"]["check"]["passed"] is True
    assert cases["bandwidth"]["check"]["passed"] is True
    optim = _bench_module("optim")
    assert [r["class"] for r in cases["optim"]["rows"]] == list(optim.CLASSES)
    assert all(r["check"]["passed"] for r in cases["optim"]["rows"])
    assert "all checks PASSED" in stdout and "FAILED" not in stdout


def test_quick_run_memory_and_bandwidth_numbers(quick_report):
    report, _ = quick_report
    mem = report["cases"]["memory"]
    assert "profiler" in mem["method"]
    for label, names in (("adamw", ADAMW_NAMES), ("mixed", MIXED_NAMES)):
        contenders = mem[label]["contenders"]
        assert set(contenders) == names
        assert set(mem[label]["ratios"]) == {"functopt fused", "functopt pure"}
        for r in mem[label]["ratios"].values():
            assert set(r) == {"state_bytes_per_param", "step_total_peak"}
            assert all(_positive_finite(x) for x in r.values())
        for name, m in contenders.items():
            assert m["persistent_bytes"] > 0 and m["step_transient_peak_bytes"] >= 0, name
            assert m["step_total_peak_bytes"] == m["persistent_bytes"] + m[
                "step_transient_peak_bytes"]
            # Adam's two moments at least (plus a float32 master in the mixed step).
            assert m["state_bytes_per_param"] >= (12.0 if label == "mixed" else 8.0), name
    # The pure path allocates new params and moments every step; the fused steps (torch's
    # and functopt's, donated) write in place and allocate next to nothing.
    adamw = mem["adamw"]["contenders"]
    assert adamw["functopt pure"]["step_transient_peak_bytes"] >= 12 * mem["params"]
    assert adamw["torch fused"]["step_transient_peak_bytes"] < mem["params"]
    assert adamw["functopt fused"]["step_transient_peak_bytes"] < mem["params"]
    # A mixed step needs the grads in float32 somewhere (the idiom's main grads, functopt
    # fused's casts, held between steps or not): bf16 params and grads, fp32 master, m, v
    # and the fp32 grads make at least 20 B/param at the peak, whoever holds what. The
    # fused step allocates at most the casts (4 B/param) during the step.
    mixed = mem["mixed"]["contenders"]
    for name, m in mixed.items():
        assert m["step_total_peak_bytes"] >= 20 * mem["params"], name
    assert mixed["functopt pure"]["step_transient_peak_bytes"] >= 12 * mem["params"]
    assert mixed["functopt fused"]["step_transient_peak_bytes"] < 5 * mem["params"]
    assert mem["mixed"]["ratios"]["functopt fused"]["step_total_peak"] <= 1.1
    assert mem["adamw"]["ratios"]["functopt fused"]["step_total_peak"] <= 1.1
    bw = report["cases"]["bandwidth"]
    assert _positive_finite(bw["bound_bytes_per_s"])
    for case, per_param in (("adamw", 28), ("mixed", 30), ("compile", 20)):
        assert bw[case]["bytes_per_param"] == per_param
        assert set(bw[case]["percent_of_bound"]) == set(report["cases"][case]["timings"])
        assert all(_positive_finite(x) for x in bw[case]["percent_of_bound"].values())


def test_quick_run_compile_case(quick_report):
    report, stdout = quick_report
    res = report["cases"]["compile"]
    assert res["params"] == report["cases"]["adamw"]["params"]
    assert res["leaves"] == report["cases"]["adamw"]["leaves"]
    assert _positive_finite(res["compile_s"])
    assert res["compile_s"] == res["first_calls_s"][0]
    assert len(res["first_calls_s"]) == 3 and all(map(_positive_finite, res["first_calls_s"]))
    assert res["check"]["passed"] is True and res["check"]["reference"] == "functopt pure"
    assert set(res["ratios"]) == {"functopt compiled/torch fused",
                                  "functopt compiled, lay_out/torch fused",
                                  "functopt pure/torch fused"}
    assert "compile time (wall time of the first call)" in stdout


def _by_name(contenders: list[Any]) -> dict[str, Any]:
    return {c.name: c for c in contenders}


def test_compare_fails_on_a_different_computation():
    C, H = _bench_module("contenders"), _bench_module("harness")
    cs = C.adamw_contenders(C.make_shapes(2_000, 4), seed=1)
    # torch fused now computes something else
    _by_name(cs)["torch fused"].opt.param_groups[0]["lr"] = 2 * C.LR
    for c in cs:
        for _ in range(3):
            c.step()
    check = H.compare(cs, rtol=1e-4, atol=1e-6)
    assert check["reference"] == "functopt pure"
    assert check["passed"] is False
    assert check["max_abs_diff"]["torch foreach"] < 1e-6
    assert check["max_abs_diff"]["functopt fused"] < 1e-6
    assert check["max_abs_diff"]["torch fused"] > 1e-4


def test_compare_reports_a_fused_contender_that_fell_back_to_the_pure_path():
    C, H = _bench_module("contenders"), _bench_module("harness")
    cs = C.adamw_contenders(C.make_shapes(2_000, 4), seed=4)
    for c in cs:
        c.step()
    assert H.compare(cs, rtol=1e-4, atol=1e-6)["passed"] is True
    fused = _by_name(cs)["functopt fused"]
    fused.step_fn = functopt.fast.make_step(fused.tx)  # no donation: new params every step
    for c in cs:
        c.step()
    check = H.compare(cs, rtol=1e-4, atol=1e-6)
    assert check["passed"] is False and check["max_abs_diff"]["functopt fused"] < 1e-6
    assert any(p.startswith("functopt fused:") and "donated fused path" in p
               for p in check["problems"])

    mcs = C.mixed_contenders(C.make_shapes(2_000, 4), seed=4)
    mixed = _by_name(mcs)["functopt fused"]
    mixed.mp = _by_name(mcs)["functopt pure"].mp  # the pure path: same values, new tensors
    for c in mcs:
        c.step()
    check = H.compare(mcs, rtol=1e-4, atol=1e-6)
    assert check["passed"] is False
    assert any(p.startswith("functopt fused:") and "donated fused path" in p
               for p in check["problems"])


def test_compare_fails_on_unequal_step_counts_and_broken_invariant():
    C, H = _bench_module("contenders"), _bench_module("harness")
    cs = C.mixed_contenders(C.make_shapes(2_000, 4), seed=2)
    for c in cs:
        c.step()
    assert H.compare(cs, rtol=1e-4, atol=1e-6)["passed"] is True
    idiom = _by_name(cs)["torch idiom"]
    idiom.step()
    check = H.compare(cs, rtol=1e-4, atol=1e-6)
    assert check["passed"] is False
    assert any("took 2 steps" in p for p in check["problems"])
    for c in cs:
        if c is not idiom:
            c.step()
    assert H.compare(cs, rtol=1e-4, atol=1e-6)["passed"] is True
    idiom.params[0].add_(1.0)  # bf16 params no longer their rounded masters
    check = H.compare(cs, rtol=1e-4, atol=1e-6)
    assert check["passed"] is False
    assert any("torch idiom" in p and "rounded masters" in p for p in check["problems"])


def test_mixed_contenders_agree_step_by_step_with_clipping_active():
    C, H = _bench_module("contenders"), _bench_module("harness")
    cs = C.mixed_contenders(C.make_shapes(200_000, 10), seed=3)
    by_name = _by_name(cs)
    for _ in range(4):
        for c in cs:
            c.step()
        assert H.compare(cs, rtol=1e-5, atol=1e-7)["passed"]
    # The grads' global norm is far above max_grad_norm, so clipping was exercised.
    pure, fused = by_name["functopt pure"], by_name["functopt fused"]
    assert float(pure.state.metrics.grad_norm) > 2 * C.MAX_GRAD_NORM
    torch.testing.assert_close(fused.state.metrics.grad_norm, pure.state.metrics.grad_norm)
    # zeros are not counted by default, as the idiom counts none
    assert int(fused.state.metrics.num_zeros) == int(pure.state.metrics.num_zeros) == -1
    scales = {float(pure.state.loss_scale.scale), float(fused.state.loss_scale.scale),
              float(by_name["torch idiom"].scale)}
    assert scales == {C.INIT_SCALE}


def test_make_shapes_hits_the_size_and_leaf_count():
    C = _bench_module("contenders")
    for total, leaves in ((1_000_000, 50), (20_000_000, 200), (1_000, 200)):
        shapes = C.make_shapes(total, leaves)
        numel = sum(math.prod(s) for s in shapes)
        assert len(shapes) == leaves
        assert numel <= total or leaves * 1 >= total  # tiny totals round d up to 1
        if total >= 1_000_000:
            assert numel >= 0.95 * total
        assert {len(s) for s in shapes} == {1, 2}  # matrices and vectors


def test_peak_step_bytes_sees_a_freed_temporary():
    H = _bench_module("harness")
    n = 1_000_000
    keep = torch.ones(n)

    def step() -> torch.Tensor:
        tmp = keep * 2  # 4 MB, freed before the step returns
        out = tmp + 1  # 4 MB, returned
        del tmp
        return out.sum()

    peak = H.peak_step_bytes(step)
    assert 8 * n <= peak < 8 * n + 64 * 1024
    assert H.peak_step_bytes(lambda: None) == 0


def test_unknown_case_is_rejected(capsys):
    run = _bench_module("run")
    with pytest.raises(SystemExit) as exc:
        run.main(["--only", "adamw,nope"])
    assert exc.value.code == 2
    assert "unknown case(s) ['nope']" in capsys.readouterr().err


def test_device_cuda_without_a_gpu_is_a_clear_error() -> None:
    """``--device cuda`` is how the suite runs on a GPU; on a machine without one it stops
    at once, saying so, instead of timing the CPU under a GPU label."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the flag is valid here")
    proc = subprocess.run(
        [sys.executable, str(BENCH / "run.py"), "--quick", "--device", "cuda"],
        capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "--device cuda: this torch has no CUDA device" in proc.stderr


def test_adafactor_benchmark_checks_the_drop_in_against_torch(capsys: Any) -> None:
    adafactor = _bench_module("adafactor")
    assert adafactor.main(["--only", "small", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    for name in ("functopt.optim.Adafactor", "torch.optim.Adafactor", "torch foreach",
                 "functopt.adafactor pure", "functopt.adafactor tier"):
        assert name in out
    assert "CHECK FAILED" not in out


def test_adafactor_benchmark_fails_when_the_drop_in_differs(capsys: Any,
                                                            monkeypatch: Any) -> None:
    adafactor = _bench_module("adafactor")
    # a drop-in with another learning rate is another computation: the check must see it
    real = functopt.optim.Adafactor
    monkeypatch.setattr(functopt.optim, "Adafactor",
                        lambda params, **kw: real(params, lr=0.1, **kw))
    assert adafactor.main(["--only", "small", "--repeats", "1"]) == 1
    assert "CHECK FAILED: functopt.optim.Adafactor" in capsys.readouterr().out


def test_muon_keller_yardstick_is_the_drop_ins_float32_maths() -> None:
    """benchmarks/muon.py's float32 yardstick (Keller Jordan's loop, transcribed) and
    ``functopt.optim.Muon(ns_dtype=None)`` are two writings of one step: they agree to
    float32 rounding over steps on wide and tall matrices, and a changed coefficient of the
    yardstick's iteration would show."""
    muon = _bench_module("muon")
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=g) * 0.02 for s in ((16, 8), (8, 24), (12, 12))]
    grads = [torch.randn(p.shape, generator=g) for p in start]
    ours = [torch.nn.Parameter(p.clone()) for p in start]
    theirs = [torch.nn.Parameter(p.clone()) for p in start]
    a = functopt.optim.Muon(ours, lr=0.02, weight_decay=0.1, ns_dtype=None)
    b = muon.KellerMuon(theirs, lr=0.02, weight_decay=0.1)
    for _ in range(3):
        for p, q, gr in zip(ours, theirs, grads, strict=True):
            p.grad, q.grad = gr.clone(), gr.clone()
        a.step()
        b.step()
    for p, q, p0 in zip(ours, theirs, start, strict=True):
        moved = float((q.detach() - p0).abs().max())
        assert moved > 1e-3  # the step did something
        assert float((p.detach() - q.detach()).abs().max()) <= 1e-5 * moved


def test_construction_benchmark_times_every_phase_and_checks_the_params(tmp_path: Path) -> None:
    construction = _bench_module("construction")
    out = tmp_path / "construction.json"
    assert construction.main(["--sizes", "3,6", "--repeats", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["class"], r["params"]) for r in rows] == [
        ("AdamW", 3), ("AdamW", 6), ("SGD", 3), ("SGD", 6)]
    for row in rows:
        assert row["agree"]
        for who in ("functopt", "torch"):
            for phase in construction.PHASES:
                assert _positive_finite(row[f"{who}_{phase}_s"]), (row, who, phase)


def test_construction_benchmark_fails_when_the_params_differ(monkeypatch: Any) -> None:
    construction = _bench_module("construction")
    sgd = torch.optim.SGD
    monkeypatch.setattr(torch.optim, "SGD",
                        lambda params, lr, **options: sgd(params, lr=2 * lr, **options))
    assert construction.main(["--sizes", "3", "--classes", "SGD", "--repeats", "1"]) == 1


def test_optim_benchmark_times_every_class_against_torchs_implementations(
        tmp_path: Path, capsys: Any) -> None:
    """One row per class, each timed against every implementation torch offers on the CPU
    (probed: Adam has a fused kernel there, NAdam has no fused= argument, Muon no foreach=)
    and checked against torch's for-loop; the ratio is over the fastest of them."""
    optim = _bench_module("optim")
    out = tmp_path / "optim.json"
    assert optim.main(["--params", "4000", "--leaves", "6", "--repeats", "1", "--threads",
                       "1", "--json", str(out)]) == 0
    stdout = capsys.readouterr().out
    rows = {r["class"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == list(optim.CLASSES)
    assert {"Adam", "AdamW", "SGD", "NAdam", "Muon", "Adafactor"} <= set(rows)
    eager = [name for name, _ in optim.IMPLEMENTATIONS]
    for name, row in rows.items():
        assert row["check"]["passed"] and row["check"]["reference"] == "torch for-loop", name
        assert set(row["check"]["max_abs_diff"]) == set(row["timings"]) - {"torch for-loop"}
        medians = {k: t["median_s"] for k, t in row["timings"].items()}
        assert all(_positive_finite(x) for x in medians.values()), name
        built = [e for e in eager if e in medians]
        assert row["torch_fastest"] == min(built, key=medians.__getitem__), name
        assert row["ratio"] == pytest.approx(medians["functopt"] / min(
            medians[e] for e in built))
        assert sum(line.startswith(f"| {name} | ") for line in stdout.splitlines()) == 1
    assert set(rows["Adam"]["timings"]) == {"functopt", *eager}
    assert "torch fused" not in rows["NAdam"]["timings"]
    assert rows["NAdam"]["missing"]["torch fused"] == "no fused= argument"
    assert set(rows["Muon"]["timings"]) == {"functopt", "torch for-loop"}
    assert all(len(s) == 2 for s in optim.matrix_shapes(4000, 6))


@pytest.mark.parametrize("name", ["Adam", "Muon"])  # Muon: the looser bfloat16 bound
def test_optim_benchmark_fails_when_a_drop_in_differs(name: str, capsys: Any,
                                                      monkeypatch: Any) -> None:
    optim = _bench_module("optim")
    real = getattr(functopt.optim, name)

    class TwiceTheRate(real):
        """Another computation: the check must see it."""

        def __init__(self, params: Any, **options: Any) -> None:
            super().__init__(params, lr=2e-3, **options)

    monkeypatch.setattr(functopt.optim, name, TwiceTheRate)
    assert optim.main(["--params", "4000", "--leaves", "6", "--repeats", "1", "--threads",
                       "1", "--classes", f"{name},SGD"]) == 1
    out = capsys.readouterr().out
    assert f"CHECK FAILED: {name}" in out and "CHECK FAILED: SGD" not in out
    assert f"| {name} | " in out and "FAILED (" in out


def test_optim_benchmark_probe_names_what_torch_cannot_do() -> None:
    optim = _bench_module("optim")
    assert optim.unavailable(torch.optim.NAdam, {"fused": True}) == "no fused= argument"
    # both at once: torch refuses when it steps, and the probe hands back its reason
    why = optim.unavailable(torch.optim.Adam, {"fused": True, "foreach": True})
    assert why is not None and why.startswith("RuntimeError: ")
    assert optim.unavailable(torch.optim.Adam, {"fused": True}) is None
