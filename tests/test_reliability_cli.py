"""Reliability suite, command line: every kind of bad flag or fault is refused before any work,
with one line on stderr that names the flag and quotes the value, and a non-zero exit status
(2 for a flag wrong on its own, 1 for flags that conflict or a run this machine cannot do)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ringdilated.cli import bench, flags, main, memory

TINY = ["--lengths", "64", "--segments", "64", "--rates", "1", "--heads", "1", "--head-dim", "8"]
TINY += ["--repeats", "1", "--no-progress"]


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``(exit status, stdout, stderr)`` of the command line, usage errors included."""
    try:
        status = main(args)
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def assert_one_line_error(err: str, command: str, *names: str) -> None:
    """One line ``ringdilated COMMAND: error: ...`` that contains every one of ``names``."""
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert err.startswith(f"ringdilated {command}: error: "), err
    for name in names:
        assert name in err, (name, err)


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a benchmark row would be measured or a rank pool started."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("work started before the flags were checked")

    monkeypatch.setattr(bench, "measure", refuse)
    monkeypatch.setattr("ringdilated.pool.Workers", refuse)


# (arguments, the flag the message must name, the offending value it must quote)
USAGE_ERRORS = [
    (["bench", "--lengths", "-5"], "--lengths", "-5"),
    (["bench", "--lengths", "0"], "--lengths", "got 0"),
    (["bench", "--lengths", "10**12"], "--lengths", "'10**12'"),
    (["bench", "--lengths", "256,x"], "--lengths", "'256,x'"),
    (["bench", "--heads", "0"], "--heads", "got 0"),
    (["bench", "--head-dim", "0"], "--head-dim", "got 0"),
    (["bench", "--dtype", "garbage"], "--dtype", "'garbage'"),
    (["bench", "--repeats", "0"], "--repeats", "got 0"),
    (["bench", "--repeats", "-3"], "--repeats", "got -3"),
    (["bench", "--world-size", "0"], "--world-size", "got 0"),
    (["bench", "--device", "mps"], "--device", "'mps'"),
    (["bench", "--segments", ""], "--segments", "''"),
    (["bench", "--rates", "1,two"], "--rates", "'1,two'"),
    (["demo", "--world-size", "0"], "--world-size", "got 0"),
    (["demo", "--world-size", "1"], "--world-size", "got 1"),
    (["demo", "--segments", "a,b"], "--segments", "'a,b'"),
    (["demo", "--length", "-8"], "--length", "got -8"),
    (["doctor", "--world-size", "0"], "--world-size", "got 0"),
    (["doctor", "--head-dim", "-1"], "--head-dim", "got -1"),
    (["doctor", "--dtype", "int32"], "--dtype", "'int32'"),
    (["doctor", "--device", "nonsense"], "--device", "'nonsense'"),
    (["verify", "--max-examples", "0"], "--max-examples", "got 0"),
    (["verify", "--max-examples", "many"], "--max-examples", "'many'"),
    (["verify", "--world-sizes", "1"], "--world-sizes", "got 1"),
    (["bench", "--bogus", "1"], "--bogus", "--bogus"),
]


@pytest.mark.parametrize(("args", "flag", "value"), USAGE_ERRORS, ids=lambda x: str(x))
def test_a_bad_flag_is_a_one_line_usage_error(
    args: list[str], flag: str, value: str, capsys: pytest.CaptureFixture[str], no_work: None
) -> None:
    status, out, err = run_cli(args, capsys)
    assert status == 2 and out == ""
    assert_one_line_error(err, args[0], flag, value)


# Flags each fine alone but conflicting, or a run this machine cannot do: status 1.
RUN_ERRORS = [
    (["bench", *TINY, "--segments", "3,5", "--rates", "1"], ["--segments 3,5", "--rates 1"]),
    (["bench", *TINY, "--segments", "8", "--rates", "16"], ["--segments 8", "--rates 16"]),
    (["bench", *TINY, "--segments", "32,64", "--rates", "1,2"], ["--heads 1"]),
    (["bench", *TINY, "--lengths", "100", "--world-size", "3"], ["--world-size 3", "[100]"]),
    (["bench", *TINY, "--dense", "--world-size", "2"], ["--dense", "--world-size"]),
    (["bench", *TINY, "--kernel", "nope"], ["--kernel nope", "known kernels"]),
    (["demo", "--length", "1000", "--world-size", "3"], ["--world-size 3", "--length 1000"]),
    (["demo", "--segments", "256,512", "--rates", "1"], ["--segments 256,512", "--rates 1"]),
]


@pytest.mark.parametrize(("args", "names"), RUN_ERRORS, ids=lambda x: str(x))
def test_conflicting_flags_are_refused_before_any_work(
    args: list[str], names: list[str], capsys: pytest.CaptureFixture[str], no_work: None
) -> None:
    status, out, err = run_cli(args, capsys)
    assert status == 1 and out == ""
    assert_one_line_error(err, args[0], "ValueError: ", *names)


@pytest.mark.parametrize("command", ["bench", "doctor"])
def test_a_missing_cuda_device_is_named(
    command: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    no_work: None,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = [command, "--device", "cuda:1", *(TINY if command == "bench" else [])]
    status, out, err = run_cli(args, capsys)
    assert status == 1 and out == ""
    assert_one_line_error(err, command, "--device cuda:1", "is_available() is False")


def test_bench_refuses_a_run_that_cannot_fit_in_memory(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, no_work: None
) -> None:
    monkeypatch.setattr(memory, "available", lambda device: (2**20, "what the test allows"))
    args = ["bench", *TINY, "--lengths", "64,8192", "--heads", "4", "--backward"]
    status, out, err = run_cli(args, capsys)
    assert status == 1 and out == ""
    need = memory.bench_bytes(8192, 4, 8, torch.float32, backward=True)
    assert_one_line_error(
        err,
        "bench",
        "MemoryError: bench needs at least",
        memory.format_bytes(need),
        "--lengths 8192",
        "but 1.0 MiB is available (what the test allows)",
        "reduce --lengths, --heads or --head-dim, or drop --backward",
    )


def test_bench_refuses_a_huge_length_with_the_real_figures(
    capsys: pytest.CaptureFixture[str], no_work: None
) -> None:
    if memory.available("cpu") is None:
        pytest.skip("no /proc/meminfo here: nothing is refused")
    status, _, err = run_cli(["bench", *TINY, "--lengths", str(10**12)], capsys)
    assert status == 1
    assert_one_line_error(err, "bench", "MemoryError", f"--lengths {10**12}", "MemAvailable")


def test_bench_counts_every_rank_and_names_world_size(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, no_work: None
) -> None:
    monkeypatch.setattr(memory, "available", lambda device: (2**30, "test"))
    args = ["bench", *TINY, "--world-size", "8", "--lengths", "64"]
    status, _, err = run_cli(args, capsys)
    assert status == 1  # eight processes of 200 MiB do not fit in 1 GiB
    assert_one_line_error(err, "bench", "--world-size 8", "or lower --world-size")


def test_demo_refuses_a_run_that_cannot_fit_in_memory(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, no_work: None
) -> None:
    monkeypatch.setattr(memory, "available", lambda device: (2**20, "test"))
    status, out, err = run_cli(["demo", "--length", "1024", "--heads", "4"], capsys)
    assert status == 1 and out == ""
    assert_one_line_error(
        err, "demo", "MemoryError: demo needs at least", "--length 1024", "--world-size"
    )


def test_memory_estimates_count_what_their_docstrings_say() -> None:
    n = 64 * 2 * 8  # (1, L, H, D) elements
    assert memory.bench_bytes(64, 2, 8, torch.float32) == 3 * n * 4 + (n * 4 + n * 4)
    assert memory.bench_bytes(64, 2, 8, torch.float64, backward=True) == 3 * n * 8 + 6 * n * 8
    assert memory.bench_bytes(64, 2, 8, torch.bfloat16, dense=True) == 3 * n * 2 + 4 * n * 2
    half = n // 2
    per_rank = 3 * half * 4 + 2 * half * 4 + 2 * half * 4 + memory.RANK_PROCESS_BYTES
    assert memory.bench_bytes(64, 2, 8, torch.float32, world_size=2) == 2 * per_rank
    big = 10**6 * 8 * 64
    assert memory.demo_bytes(10**6, 8, 64, 2) == 104 * big
    assert memory.demo_bytes(64, 2, 8, 2) == 48 * n + 2 * (16 * n + memory.RANK_PROCESS_BYTES)


def test_available_memory_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (5 * 2**30, 8 * 2**30))
    assert memory.available("cuda:0") == (5 * 2**30, "free on cuda:0 (torch.cuda.mem_get_info)")
    monkeypatch.setattr(memory, "_mem_available", lambda: None)
    assert memory.available("cpu") is None
    memory.require_fits("bench", 10**30, "cpu", "anything", "nothing")  # no figure: no refusal


@pytest.mark.parametrize(
    ("flag", "make"),
    [
        ("--json", lambda tmp: tmp / "missing" / "rows.json"),
        ("--csv", lambda tmp: tmp),
        ("--plot", lambda tmp: tmp / "no" / "such" / "dir" / "plot.png"),
    ],
)
def test_output_paths_are_checked_before_the_run(
    flag: str, make: object, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_work: None
) -> None:
    path = make(tmp_path)  # type: ignore[operator]
    status, out, err = run_cli(["bench", *TINY, flag, str(path)], capsys)
    assert status == 2 and out == ""
    assert_one_line_error(err, "bench", f"argument {flag}: ", repr(str(path)))
    assert not (tmp_path / "missing").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_an_unwritable_output_directory_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_work: None
) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        status, _, err = run_cli(["bench", *TINY, "--json", str(locked / "x.json")], capsys)
    finally:
        locked.chmod(0o700)
    assert status == 2
    assert_one_line_error(err, "bench", "argument --json: ", "is not writable")


def test_a_writable_output_path_passes_and_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "rows.csv"
    target.write_text("old")  # an existing file is overwritten
    status, _, err = run_cli(["bench", *TINY, "--csv", str(target)], capsys)
    assert status == 0 and err == ""
    assert target.read_text().startswith("length,")


@pytest.mark.parametrize(
    ("alias", "name"),
    [
        ("bf16", "bfloat16"),
        ("BFloat16", "bfloat16"),
        ("fp16", "float16"),
        ("half", "float16"),
        ("fp32", "float32"),
        ("float", "float32"),
        ("torch.float32", "float32"),
        ("fp64", "float64"),
        ("double", "float64"),
        ("float64", "float64"),
    ],
)
def test_dtype_aliases_map_to_torch_dtypes(alias: str, name: str) -> None:
    assert flags.dtype_name(alias) == name
    assert flags.dtype_or_auto(alias) == name
    assert flags.to_dtype(name) == getattr(torch, name)


def test_dtype_aliases_reach_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli(["bench", *TINY, "--dtype", "bf16"], capsys)
    assert status == 0 and out.splitlines()[2].split()[:2] == ["64", "1"]
    status, out, _ = run_cli(["doctor", "--device", "cpu", "--dtype", "fp64"], capsys)
    assert status == 0 and "cpu, float64, head_dim 64" in out


def test_verify_max_examples_zero_checks_nothing_and_says_so(
    capsys: pytest.CaptureFixture[str], no_work: None
) -> None:
    status, out, err = run_cli(["verify", "--max-examples", "0", "--no-progress"], capsys)
    assert status == 2 and out == ""
    assert_one_line_error(err, "verify", "argument --max-examples: must be at least 1, got 0")


@pytest.mark.parametrize(
    ("variable", "value", "fragment"),
    [
        ("RINGDILATED_STRICT_PLUGINS", "yes-please", "must be one of ('1', 'true'"),
        ("RINGDILATED_DISABLE_PLUGIN_AUTOLOAD", "maybe", "must be one of ('1', 'true'"),
        ("RINGDILATED_BLOCK_PLUGINS", "flexx", "names 'flexx', not a built-in plugin"),
        ("RINGDILATED_PACKAGES", "flash-attn", "names 'flash-attn', not a package"),
        ("RINGDILATED_AGREE_EVERY_CALL", "2", "must be one of ('1', 'true'"),
    ],
)
def test_doctor_refuses_a_variable_it_does_not_understand(
    variable: str,
    value: str,
    fragment: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 21, item 6: these were taken as unset, and doctor reported a healthy setup."""
    from ringdilated.plugins import load_registry
    from ringdilated.registry import default_resolver

    monkeypatch.setenv(variable, value)
    load_registry.cache_clear()
    default_resolver.cache_clear()
    try:
        status, _, err = run_cli(["doctor", "--device", "cpu", "--dtype", "float32"], capsys)
    finally:
        monkeypatch.delenv(variable)
        load_registry.cache_clear()
        default_resolver.cache_clear()
    assert status == 1
    assert_one_line_error(err, "doctor", f"ValueError: {variable}", repr(value), fragment)
