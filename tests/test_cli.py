"""The ``ringdilated`` command line: every command runs, prints what it promises, writes its
files, fails with one line (and a non-zero status), and has ``--help``."""

from __future__ import annotations

import csv
import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys
import types
from collections.abc import Callable

import attrs
import pytest
import torch

from ringdilated.backends.reference import REFERENCE_SPEC, ReferenceKernel
from ringdilated.cli import main
from ringdilated.functional import default_resolver


@pytest.mark.parametrize("command", ["doctor", "bench", "verify", "demo"])
def test_every_command_prints_its_usage_on_help(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert f"usage: ringdilated {command}" in capsys.readouterr().out


def test_python_dash_m() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ringdilated", "--help"], capture_output=True, text=True, check=True
    )
    assert "doctor" in result.stdout and "verify" in result.stdout


def _doctor(capsys: pytest.CaptureFixture[str]) -> str:
    args = ["doctor", "--causal", "--head-dim", "32", "--world-size", "4", "--length", "4096"]
    args += ["--segments", "1024,4096", "--rates", "1,4", "--heads", "2", "--batch", "8"]
    assert main(args) == 0
    return capsys.readouterr().out


def test_doctor_reports_torch_dtype_policy_and_plugins(capsys: pytest.CaptureFixture[str]) -> None:
    out = _doctor(capsys)
    assert "torch 2." in out and "recommended dtype on cpu: torch.float32" in out
    assert any(
        line.split()[:2] == ["ringdilated.backends.sdpa", "built-in"] for line in out.splitlines()
    )


def test_doctor_explains_kernel_and_communicator_choice(
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = _doctor(capsys)
    assert "kernel: sdpa (priority 100, highest priority that fits)" in out
    assert "rejected flash: package 'flash_attn' is not importable; runs on cuda, not cpu" in out
    assert "sample sharded call: L=4096 over 4 ranks, segments [1024, 4096]" in out
    # Head 1 (segment 4096, rate 4) selects 256 positions per shard of 1024; one position's key
    # and value weigh 2 * 8 * 32 * 4 B = 2 KiB. Causal: rank 0 sends its 256 to 3 later ranks
    # (1.5 MiB) in 3 steps; allgather sends every rank's 256 to all 3 peers in one step, so rank
    # 3 sends 1.5 MiB above its minimum of 0, and every rank also receives 1.5 MiB: at gloo's
    # 1.5 GB/s that costs more than ringpass's two extra steps.
    assert "communicator: ringpass (least modelled time that fits) for 4 rank(s)" in out
    assert (
        "  ringpass: per rank sends 0 B to 1.5 MiB (the minimum), receives 0 B to 1.5 MiB; "
        "3 step(s)" in out
    )
    assert (
        "not chosen allgather: per rank sends 1.5 MiB, up to 1.5 MiB above the minimum, "
        "receives 1.5 MiB; 1 step(s)" in out
    )


def test_bench_writes_table_json_and_csv(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "--lengths", "256,512", "--segments", "128,256", "--rates", "1,2"]
    args += ["--backward", "--dense", "--repeats", "1", "--no-progress"]
    args += ["--json", str(tmp_path / "b.json"), "--csv", str(tmp_path / "b.csv")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:3] == ["length", "ranks", "forward_s"]
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert [r["length"] for r in rows] == [256, 512]
    assert all(r["forward_s"] > 0 and r["fwd_bwd_gflops"] > 0 and r["dense_s"] > 0 for r in rows)
    with open(tmp_path / "b.csv") as f:
        assert [int(r["length"]) for r in csv.DictReader(f)] == [256, 512]


def test_bench_on_two_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "--lengths", "512", "--segments", "128,512", "--rates", "1,2"]
    assert main([*args, "--world-size", "2", "--repeats", "1", "--no-progress"]) == 0
    row = capsys.readouterr().out.splitlines()[2].split()
    assert row[:2] == ["512", "2"]


def test_errors_are_one_line_and_debug_shows_the_traceback(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["bench", "--segments", "3,5", "--rates", "1"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("ringdilated bench: error: ValueError: segment_lengths and dilation")
    with pytest.raises(ValueError, match="segment_lengths and dilation_rates"):
        main(["--debug", "bench", "--segments", "3,5", "--rates", "1"])
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["bench", "--lengths", "64", "--plot", "x.png"]) == 1
    err = capsys.readouterr().err
    assert "--plot needs matplotlib: pip install -e '.[plot]' (in the ringdilated clone)" in err
    assert main(["bench", "--lengths", "100", "--world-size", "3"]) == 1
    assert "lengths [100] are not divisible by --world-size 3" in capsys.readouterr().err


def test_verify_passes_and_fails(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    args = ["verify", "--only", "reference", "--only", "ringpass", "--only", "flash"]
    assert main([*args, "--world-sizes", "2", "--max-examples", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "kernel        reference  pass" in out
    assert "flash      skipped  declares no cpu target (cuda)" in out
    assert "communicator  ringpass   pass     matches-local" in out

    class IgnoresScale(ReferenceKernel):
        def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
            return super().forward(q, k, v, attrs.evolve(options, scale=1.0))

    wrong = attrs.evolve(REFERENCE_SPEC, name="wrong", factory=IgnoresScale, priority=-50)
    monkeypatch.setitem(default_resolver().specs, "wrong", wrong)
    assert main(["verify", "--only", "wrong", "--max-examples", "10", "--no-progress"]) == 1
    out = capsys.readouterr().out
    (row,) = [line.split(maxsplit=3) for line in out.splitlines() if line.startswith("kernel ")]
    assert row[:3] == ["kernel", "wrong", "FAIL"] and row[3].startswith("[forward] ")
    assert ": max error" in row[3]
    assert main(["verify", "--only", "nonexistent"]) == 1
    assert "--only names unknown backends: nonexistent" in capsys.readouterr().err


def test_demo_on_two_ranks_reproduces_one_process(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["demo", "--length", "1024", "--segments", "256,512,1024", "--heads", "4"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "kernel: sdpa" in out and "communicator: ringpass" in out
    assert "rank 1 of 2: forward" in out
    assert out.rstrip().endswith("PASS: 2 ranks reproduce one process")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer on a machine without CUDA")
def test_verify_on_a_missing_device_verifies_nothing_and_says_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["verify", "--device", "cuda", "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "nothing was verified: --device cuda, but torch.cuda.is_available() is False" in out


def test_verify_exits_non_zero_when_nothing_or_not_everything_was_checked(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(SystemExit) as exit_info:  # a usage error: argparse's status 2
        main(["verify", "--max-examples", "0"])
    assert exit_info.value.code == 2
    assert "argument --max-examples: must be at least 1, got 0" in capsys.readouterr().err
    assert main(["verify", "--only", "flash", "--no-progress"]) == 1
    assert "nothing was verified on cpu" in capsys.readouterr().out

    def broken() -> object:
        raise ImportError("its extension did not load")

    spec = attrs.evolve(REFERENCE_SPEC, name="broken", factory=broken)
    monkeypatch.setitem(default_resolver().specs, "broken", spec)
    args = ["verify", "--only", "broken", "--only", "reference", "--max-examples", "2"]
    assert main([*args, "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "broken     unavailable  ImportError: its extension did not load" in out
    assert "on cpu: 1 passed, 0 failed, 1 unavailable, 0 skipped" in out


SMALL_BENCH = ["bench", "--lengths", "64,128", "--segments", "32,64", "--rates", "1,2"]
SMALL_BENCH += ["--heads", "2", "--head-dim", "8", "--repeats", "1", "--no-progress"]


class _Axis:
    """A matplotlib axis that records the labels of the lines drawn on it."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def plot(self, x: list[int], y: list[float], **kwargs: object) -> None:
        assert len(x) == len(y) and all(isinstance(value, float) for value in y)
        self.lines.append(str(kwargs["label"]))

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None


def _fake_matplotlib(monkeypatch: pytest.MonkeyPatch) -> tuple[_Axis, _Axis]:
    """Install a matplotlib whose ``subplots`` hands out two recording axes (time, memory)."""
    left, right = _Axis(), _Axis()
    figure = types.SimpleNamespace(
        suptitle=lambda *a: None,
        tight_layout=lambda: None,
        savefig=lambda path, **kw: pathlib.Path(path).write_bytes(b"png"),
    )
    pyplot = types.ModuleType("matplotlib.pyplot")
    pyplot.subplots = lambda *a, **kw: (figure, (left, right))  # type: ignore[attr-defined]
    pyplot.close = lambda fig: None  # type: ignore[attr-defined]
    matplotlib = types.ModuleType("matplotlib")
    matplotlib.use = lambda backend: None  # type: ignore[attr-defined]
    matplotlib.pyplot = pyplot  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "matplotlib", matplotlib)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", pyplot)
    return left, right


def test_bench_plot_draws_every_series_dense_included(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 21, item 10: ``--plot`` drew forward and forward+backward but not ``--dense``."""
    time_axis, memory_axis = _fake_matplotlib(monkeypatch)
    plot = tmp_path / "b.png"
    assert main([*SMALL_BENCH, "--backward", "--dense", "--plot", str(plot)]) == 0
    assert plot.read_bytes() == b"png"
    assert time_axis.lines == ["forward", "forward+backward", "dense SDPA"]
    assert memory_axis.lines == ["forward", "forward+backward", "dense SDPA"]
    header = capsys.readouterr().out.splitlines()[0].split()
    assert header[-3:] == ["dense_s", "dense_gflops", "dense_peak_mib"]


def test_bench_json_records_versions_device_and_machine(tmp_path: pathlib.Path) -> None:
    """Issue 21, item 10: the JSON recorded no torch version, device or machine."""
    import ringdilated

    assert main([*SMALL_BENCH, "--json", str(tmp_path / "b.json")]) == 0
    environment = json.loads((tmp_path / "b.json").read_text())["environment"]
    assert environment["torch"] == torch.__version__
    assert environment["ringdilated"] == ringdilated.__version__
    assert environment["python"] == platform.python_version()
    device = environment["device"]
    assert device["type"] == "cpu" and isinstance(device["name"], str) and device["name"]
    machine = environment["machine"]
    assert machine["architecture"] == platform.machine()
    assert machine["system"] == platform.platform()
    assert machine["logical_cpus"] == os.cpu_count() and machine["ranks"] == 1
    assert machine["threads_per_rank"] == torch.get_num_threads()
    assert machine["memory_gib"] is None or machine["memory_gib"] > 0
    when = datetime.datetime.fromisoformat(environment["time_utc"])
    assert when.utcoffset() == datetime.timedelta(0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bench_environment_names_the_cuda_device() -> None:
    from ringdilated.cli.bench import environment

    device = environment("cuda")["device"]
    assert device["name"] == torch.cuda.get_device_name(0)
    major, minor = torch.cuda.get_device_capability(0)
    assert device["compute_capability"] == f"{major}.{minor}"
    assert device["cuda"] == torch.version.cuda and device["memory_gib"] > 0
