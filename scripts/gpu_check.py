#!/usr/bin/env python
"""The GPU check in one command (issue 20, item 8): run it first on any machine with a GPU.

::

    PYTHONPATH=src python scripts/gpu_check.py                 # cuda, the full check
    PYTHONPATH=src python scripts/gpu_check.py --quick         # smaller, for a first look
    PYTHONPATH=src python scripts/gpu_check.py --device cpu --quick   # tiny sizes, no GPU

Offline, with the machine's own torch: it imports only the standard library, torch,
ringdilated (and its dependencies attrs and pluggy), and, each guarded, hypothesis (for the
conformance kits), flash_attn, flash_attn_interface (FlashAttention 3), flash_attn.cute
(FlashAttention 4), xformers, triton and transformers.
Nothing is installed or downloaded.

Sections, each with its own time budget and its own failure (a section that raises is recorded
with its traceback and the next one runs; a section past its budget stops between cases and lists
what it did not run):

1. Environment: torch, CUDA, cuDNN, the device, the optional packages that import, and the
   resolver's choice for a bf16 request (``ringdilated doctor``'s sample call).
2. The kernel conformance kits (:func:`ringdilated.testing.check_kernel`) on the device, for
   every kernel that declares it, one row per kernel and dtype (bf16, fp16, fp32).
3. The public API (:func:`ringdilated.dilated_attention`, each kernel forced by name) against the
   float64 oracle: out, lse, dq, dk, dv, both modes, causal or not, grouped-query heads, documents
   (a :class:`ringdilated.SequenceLayout`) and padding, judged by the tolerance rule.
4. No host synchronisation in planned layer calls: forward and backward of ``DilatedAttention``
   and ``MultiheadDilatedAttention`` on a layout, after one planning call, under
   ``torch.cuda.set_sync_debug_mode("error")``, and counted by ``HotPathCounter``.
5. CUDA-graph capture and replay of a planned layer's forward, against eager calls.
6. Throughput: the pattern's TFLOP/s (``DilationPattern.flops``) forward and forward+backward in
   bf16, next to dense ``scaled_dot_product_attention`` on its flash backend at the same L.

The report is Markdown (printed, and written to ``--report``) with a JSON twin of the raw
figures (the same path with ``.json``), both rewritten after every row, so a run cut short still
leaves what it measured. Exit status: 0 when no section failed, 1 otherwise (also when
``--device cuda`` finds no CUDA device: nothing was checked).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def _prepare_imports() -> None:
    """Use this checkout's ``src`` when ringdilated is not importable, and say what is missing
    (ringdilated needs attrs and pluggy) before anything fails deep inside an import."""
    if importlib.util.find_spec("ringdilated") is None and (ROOT / "src").is_dir():
        sys.path.insert(0, str(ROOT / "src"))
    missing = [name for name in ("attrs", "pluggy") if importlib.util.find_spec(name) is None]
    if missing:
        sys.exit(
            f"gpu_check: ringdilated needs {', '.join(missing)}, which this Python cannot import "
            "(no pip here: use a Python that has them)"
        )


_prepare_imports()

import attrs  # noqa: E402

import ringdilated  # noqa: E402
from ringdilated.core import Environment, Request  # noqa: E402
from ringdilated.registry import default_resolver  # noqa: E402
from ringdilated.testing import (  # noqa: E402
    FLOORS,
    allowed_error,
    dense_attention,
    max_error,
    oracle,
)
from ringdilated.testing.hot_path import HotPathCounter  # noqa: E402

SECTIONS = {
    1: "Environment",
    2: "Conformance kits",
    3: "Oracle comparison through the public API",
    4: "No host sync in planned layer calls",
    5: "CUDA-graph capture and replay",
    6: "Throughput against dense SDPA (flash)",
}
# Soft budgets in seconds: a section stops between cases once its budget is spent.
BUDGETS = {
    ("cuda", False): {1: 30, 2: 120, 3: 90, 4: 45, 5: 45, 6: 100},
    ("cuda", True): {1: 30, 2: 60, 3: 45, 4: 30, 5: 30, 6: 60},
    ("cpu", False): {1: 30, 2: 120, 3: 90, 4: 45, 5: 10, 6: 60},
    ("cpu", True): {1: 30, 2: 60, 3: 60, 4: 30, 5: 10, 6: 45},
}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Kernels in the order they are checked: the fused ones first, flex (which compiles) last.
KERNEL_ORDER = (
    "flash4",
    "flash3",
    "flash",
    "cudnn",
    "torch_flash",
    "sdpa",
    "xformers",
    "reference",
    "flex",
)
# Kernels the throughput section times (the reference kernel is plain math, not a fast path).
FAST_KERNELS = ("flash4", "flash3", "flash", "cudnn", "torch_flash", "sdpa", "xformers", "flex")
OPTIONAL_PACKAGES = (
    "flash_attn",
    "flash_attn_interface",
    "flash_attn.cute",
    "xformers",
    "triton",
    "transformers",
    "hypothesis",
)
NO_CUDA = "skipped: no CUDA device"


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(
        dtype, str(dtype).removeprefix("torch.")
    )


def first_line(text: object, limit: int = 300) -> str:
    lines = str(text).strip().splitlines()
    line = lines[0] if lines else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def chain(exc: BaseException, limit: int = 300) -> str:
    """``exc`` and the exceptions it was raised during or from, the first one first (a failed
    capture raises again when ``torch.cuda.graph`` closes: the first error is the cause)."""
    found: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in found and len(found) < 5:
        found.append(current)
        current = current.__cause__ or current.__context__
    return " -> then ".join(f"{type(e).__name__}: {first_line(e, limit)}" for e in reversed(found))


def record_failure(row: dict[str, Any], exc: BaseException, status: str = "error") -> None:
    """``row`` marked as failed by ``exc``, with its traceback in the JSON twin; a kernel the
    resolver cannot build or that declines the request (``ResolutionError``: an optional
    package too old or broken, say) is ``unavailable``, which is not a failure."""
    if isinstance(exc, ringdilated.ResolutionError):
        row["status"] = "unavailable: " + first_line(exc)
        return
    row["status"] = status
    row["message"] = chain(exc)
    row["_traceback"] = traceback.format_exc()


# --------------------------------------------------------------------------------------------
# Sizes


@dataclass(frozen=True)
class Sizes:
    """Every size the sections use, for one device kind and ``--quick``."""

    max_examples: int
    case_space: dict[str, Any]  # CaseSpace arguments for the conformance kits
    oracle: dict[str, Any]
    oracle_cases: int | None  # None: every combination of mode, causal and variant
    oracle_leave_out: dict[str, str]  # kernel: why section 3 leaves it out at these sizes
    layer: dict[str, Any]  # sections 4 and 5
    bench: dict[str, Any]


def sizes_for(device_type: str, quick: bool, max_examples: int | None) -> Sizes:
    if device_type == "cuda":
        oracle_sizes = {
            "batch": 2,
            "length": 512,
            "heads": 8,
            "kv_heads": 2,
            "head_dim": 64,
            "segments": [64, 128, 256],
            "rates": [1, 2, 4],
            "cu_seqlens": [0, 100, 300, 512],
            "padding": (37, 80),  # row 0: right padding, row 1: left padding
        }
        layer = {
            "batch": 2,
            "length": 4096,
            "heads": 8,
            "kv_heads": 2,
            "head_dim": 64,
            "segments": [512, 1024, 2048],
            "rates": [1, 2, 4],
            "cu_seqlens": [0, 1000, 3000, 4096],
            "padding": (300, 517),
        }
        bench = {
            "batch": 1,
            "heads": 16,
            "head_dim": 128,
            "lengths": [8192, 16384] if quick else [16384, 65536],
            "segments": [2048, 4096, 8192, 16384],
            "rates": [1, 2, 4, 8],
            "warmup": 2,
            "repeats": 3 if quick else 5,
        }
        return Sizes(
            max_examples=max_examples or (4 if quick else 10),
            case_space={},  # the kit's own default space
            oracle=oracle_sizes,
            oracle_cases=6 if quick else None,
            oracle_leave_out={},
            layer=layer,
            bench=bench,
        )
    small = {
        "batch": 2,
        "length": 64,
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 16,
        "segments": [8, 16, 32],
        "rates": [1, 2, 4],
        "cu_seqlens": [0, 13, 40, 64],
        "padding": (5, 9),
    }
    bench = {
        "batch": 1,
        "heads": 4,
        "head_dim": 32,
        "lengths": [256] if quick else [256, 1024],
        "segments": [32, 64, 128, 256],
        "rates": [1, 2, 4, 8],
        "warmup": 1,
        "repeats": 3,
    }
    return Sizes(
        max_examples=max_examples or (2 if quick else 5),
        case_space={"max_len": 40, "max_head_dim": 32, "max_batch": 2, "max_work": 1 << 16},
        oracle=small,
        oracle_cases=4 if quick else 6,
        oracle_leave_out={
            "flex": "left out by --quick on cpu: eager FlexAttention recompiles for every shape "
            "(about 1 s a call here); its CPU forward is checked in section 2"
        }
        if quick
        else {},
        layer=small,
        bench=bench,
    )


# --------------------------------------------------------------------------------------------
# The report


@dataclass
class Section:
    number: int
    title: str
    budget: float
    status: str = "not run"
    seconds: float = 0.0
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    blocks: list[tuple[str, str]] = field(default_factory=list)  # (caption, preformatted text)
    warnings: list[str] = field(default_factory=list)
    not_run: list[str] = field(default_factory=list)
    error: str | None = None
    _start: float = 0.0

    def time_left(self) -> float:
        return self.budget - (time.perf_counter() - self._start)

    def over_budget(self, what: str) -> bool:
        """True (and ``what`` recorded as not run) once the budget is spent."""
        if self.time_left() > 0:
            return False
        self.not_run.append(what)
        return True

    def finish(self) -> None:
        self.seconds = time.perf_counter() - self._start
        statuses = [row.get("status", "info") for row in self.rows]
        if self.error is not None or "error" in statuses:
            self.status = "error" if self.error is not None else "FAIL"
        elif "FAIL" in statuses:
            self.status = "FAIL"
        elif self.not_run:
            self.status = "partial"
        elif self.rows and all(str(s).startswith(("skipped", "unavailable")) for s in statuses):
            self.status = "skipped"
        else:
            self.status = "pass"


class Report:
    def __init__(self, path: Path, command: str, device: str) -> None:
        self.path = path
        self.json_path = path.with_suffix(".json")
        self.command = command
        self.device = device
        self.started = datetime.datetime.now(datetime.timezone.utc)
        self.sections: list[Section] = []
        self.finished: datetime.datetime | None = None

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for s in self.sections:
            counts[s.status] = counts.get(s.status, 0) + 1
        return ", ".join(f"{n} {status}" for status, n in counts.items())

    def markdown(self) -> str:
        end = self.finished or datetime.datetime.now(datetime.timezone.utc)
        lines = [
            "# ringdilated GPU check",
            "",
            f"- command: `{self.command}`",
            f"- device: {self.device}",
            f"- started {self.started.isoformat(timespec='seconds')}, "
            f"{'finished' if self.finished else 'still running at'} "
            f"{end.isoformat(timespec='seconds')} "
            f"({(end - self.started).total_seconds():.0f} s)",
            f"- sections: {self.summary() or 'none yet'}",
            "",
            "| section | status | time (s) | budget (s) | rows |",
            "|---|---|---|---|---|",
        ]
        for s in self.sections:
            lines.append(
                f"| {s.number}. {s.title} | {s.status} | {s.seconds:.1f} | {s.budget:.0f} "
                f"| {len(s.rows)} |"
            )
        for s in self.sections:
            lines += ["", f"## {s.number}. {s.title}: {s.status}", ""]
            lines.append(f"{s.seconds:.1f} s of a {s.budget:.0f} s budget.")
            if s.rows:
                lines += ["", *_table(s.rows)]
            for note in s.notes:
                lines += ["", note]
            for caption, text in s.blocks:
                lines += ["", caption, "", "```text", text.rstrip(), "```"]
            if s.not_run:
                lines += [
                    "",
                    f"Not run (budget of {s.budget:.0f} s spent): " + "; ".join(s.not_run),
                ]
            if s.warnings:
                lines += ["", "Warnings:", ""]
                lines += [f"- {_cell(w)}" for w in s.warnings]
            if s.error:
                lines += ["", "The section raised:", "", "```text", s.error.rstrip(), "```"]
        return "\n".join(lines) + "\n"

    def as_json(self) -> dict[str, Any]:
        return {
            "command": self.command,
            "device": self.device,
            "started": self.started.isoformat(),
            "finished": None if self.finished is None else self.finished.isoformat(),
            "sections": [
                {
                    "number": s.number,
                    "title": s.title,
                    "status": s.status,
                    "seconds": s.seconds,
                    "budget": s.budget,
                    "rows": s.rows,
                    "notes": s.notes,
                    "blocks": [{"caption": c, "text": t} for c, t in s.blocks],
                    "warnings": s.warnings,
                    "not_run": s.not_run,
                    "error": s.error,
                }
                for s in self.sections
            ],
        }

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(self.markdown())
        self.json_path.write_text(json.dumps(self.as_json(), indent=1, default=str) + "\n")


def _cell(value: object) -> str:
    text = f"{value:.4g}" if isinstance(value, float) else "" if value is None else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


_LAST = ("status", "note", "message")


def _table(rows: list[dict[str, Any]]) -> list[str]:
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if not k.startswith("_") and k not in keys]
    keys = [k for k in keys if k not in _LAST] + [k for k in _LAST if k in keys]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_cell(row.get(k, "")) for k in keys) + " |" for row in rows]
    return lines


@dataclass
class Context:
    device: torch.device
    cuda: bool  # the requested device is CUDA and a CUDA device exists
    quick: bool
    sizes: Sizes
    kernels: list[str] | None  # --kernels
    report: Report
    resolver: Any = None
    env: Any = None

    @property
    def device_type(self) -> str:
        return self.device.type

    def capability(self) -> tuple[int, int] | None:
        if self.device_type == "cuda" and not self.cuda:
            return None
        return self.env.capability(self.device)

    def fast_dtype(self) -> torch.dtype:
        """bf16 where the device has it (CUDA 8.0+, CPU), else fp16."""
        if self.cuda and torch.cuda.get_device_capability(self.device) < (8, 0):
            return torch.float16
        return torch.bfloat16

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


def run_section(ctx: Context, section: Section, body: Callable[[Context, Section], None]) -> None:
    ctx.report.sections.append(section)
    section._start = time.perf_counter()
    section.status = "running"
    ctx.report.write()
    print(f"\n== {section.number}. {section.title} (budget {section.budget:.0f} s)", flush=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        try:
            body(ctx, section)
        except Exception:
            section.error = traceback.format_exc()
            print(section.error, flush=True)
    if ctx.cuda:
        with _quiet():
            try:
                torch.cuda.empty_cache()
            except Exception as exc:  # a broken context: the next section will say more
                section.notes.append(f"torch.cuda.empty_cache() raised {chain(exc)}")
    seen: list[str] = []
    for w in caught:
        text = f"{w.category.__name__}: {first_line(w.message, 240)} ({Path(w.filename).name})"
        if text not in seen:
            seen.append(text)
    section.warnings = seen[:12] + ([f"... {len(seen) - 12} more"] if len(seen) > 12 else [])
    section.finish()
    ctx.report.write()
    print(f"-- {section.number}. {section.title}: {section.status} ({section.seconds:.1f} s)")


def add_row(ctx: Context, section: Section, row: dict[str, Any]) -> None:
    section.rows.append(row)
    shown = {k: v for k, v in row.items() if not k.startswith("_")}
    print("  " + ", ".join(f"{k}={_cell(v)}" for k, v in shown.items()), flush=True)
    ctx.report.write()


def kernel_names(ctx: Context, among: Sequence[str] | None = None) -> list[str]:
    """Kernels the resolver lists with a target on the device, important ones first."""
    specs = ctx.resolver.specs
    names = [n for n in specs if any(t.device_type == ctx.device_type for t in _targets(specs[n]))]
    if among is not None:
        names = [n for n in names if n in among]
    if ctx.kernels is not None:
        names = [n for n in names if n in ctx.kernels]
    return sorted(names, key=lambda n: (*KERNEL_ORDER, n).index(n))


def _targets(spec: Any) -> tuple[Any, ...]:
    return tuple(spec.capabilities.targets)


def missing_packages(ctx: Context, name: str) -> list[str]:
    spec = ctx.resolver.specs[name]
    return [p for p in spec.capabilities.requires if not ctx.env.has_package(p)]


def reasons(ctx: Context, name: str, dtype: torch.dtype, **request: Any) -> tuple[str, ...]:
    """Why kernel ``name`` would not serve this request on the device (empty: it would)."""
    req = Request(
        device_type=ctx.device_type,
        dtype=dtype,
        compute_capability=ctx.capability(),
        **request,
    )
    return tuple(ctx.resolver.specs[name].reasons(req, ctx.env))


# --------------------------------------------------------------------------------------------
# 1. Environment


def section_environment(ctx: Context, section: Section) -> None:
    def row(item: str, value: object) -> None:
        add_row(ctx, section, {"item": item, "value": value})

    row("python", f"{platform.python_version()} ({sys.executable})")
    row("platform", f"{platform.platform()}, {os.cpu_count()} CPUs")
    row("torch", f"{torch.__version__} ({Path(torch.__file__).parent})")
    row("ringdilated", f"{ringdilated.__version__} ({Path(ringdilated.__file__).parent})")
    row("checkout", _git_revision())
    row("CUDA (torch build)", torch.version.cuda or "none (CPU build)")
    if torch.version.hip:
        row("HIP", torch.version.hip)
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    row("cuDNN", cudnn or "not available")
    row("CUDA available", torch.cuda.is_available())
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            row(
                f"cuda:{i}",
                f"{p.name}, compute capability {p.major}.{p.minor}, "
                f"{p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs",
            )
        driver = getattr(torch._C, "_cuda_getDriverVersion", None)
        if driver is not None:
            try:
                with _quiet():
                    row("CUDA driver", driver())
            except Exception as exc:
                row("CUDA driver", f"unknown ({type(exc).__name__})")
    row("device checked", ctx.report.device)
    for name in OPTIONAL_PACKAGES:
        row(f"import {name}", _try_import(name))
    if ctx.device_type == "cuda" and not ctx.cuda:
        row("recommended dtype", NO_CUDA)
        row("kernel for a bf16 request", NO_CUDA)
    else:
        row("recommended dtype", str(ringdilated.recommended_dtype(ctx.device, ctx.env)))
        _bf16_choice(ctx, section, row)
    from ringdilated.plugins import load_registry

    try:
        section.blocks.append(("Plugins:", load_registry().describe()))
    except Exception as exc:
        row("plugins", f"the registry could not be built: {first_line(exc)}")
    for failure in ctx.resolver.plugin_failures:
        row("plugin failed", failure)


def _bf16_choice(ctx: Context, section: Section, row: Callable[[str, object], None]) -> None:
    """The resolver's choice for a bf16 request, as ``ringdilated doctor`` shows it."""
    request = Request(
        device_type=ctx.env.device_type(ctx.device),
        dtype=torch.bfloat16,
        head_dim=128,
        compute_capability=ctx.capability(),
        window=True,
        backward=True,
    )
    try:
        plan = ctx.resolver.resolve(request)
    except ringdilated.ResolutionError as exc:
        row("kernel for a bf16 request", f"none: {first_line(exc)}")
        return
    row("kernel for a bf16 request", plan.kernel_name)
    section.blocks.append(("The resolver's explain() for that request:", plan.explain()))


def _git_revision() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({type(exc).__name__})"
    return out.stdout.strip() or "unknown (not a git checkout)"


def _try_import(name: str) -> str:
    try:
        with _quiet():
            if importlib.util.find_spec(name) is None:  # a dotted name imports its parent
                return "not installed"
            module = importlib.import_module(name)
    except Exception as exc:  # a broken build is worth reporting, not fatal
        return f"installed, import fails: {type(exc).__name__}: {first_line(exc, 160)}"
    return f"yes, {getattr(module, '__version__', 'version unknown')}"


@contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# --------------------------------------------------------------------------------------------
# 2. Conformance kits


def restricted(spec: Any, device_type: str, dtype: torch.dtype) -> Any | None:
    """``spec`` declaring only ``dtype`` on ``device_type`` (other devices unchanged), so that
    the kit draws only that dtype; ``None`` when it declares no such target."""
    targets = []
    found = False
    for t in _targets(spec):
        if t.device_type != device_type:
            targets.append(t)
        elif dtype in t.dtypes:
            targets.append(attrs.evolve(t, dtypes=frozenset({dtype})))
            found = True
    if not found:
        return None
    capabilities = attrs.evolve(spec.capabilities, targets=tuple(targets))
    return attrs.evolve(spec, capabilities=capabilities)


def section_conformance(ctx: Context, section: Section) -> None:
    if not ctx.cuda and ctx.device_type == "cuda":
        add_row(ctx, section, {"kernel": "-", "dtype": "-", "status": NO_CUDA})
        return
    try:
        from ringdilated.testing.conformance import CHECKS, CaseSpace, check_kernel
    except ImportError as exc:
        add_row(ctx, section, {"kernel": "-", "status": f"skipped: {exc}"})
        return
    space = CaseSpace(**ctx.sizes.case_space)
    section.notes.append(
        f"`check_kernel(spec, device={ctx.device_type!r}, max_examples="
        f"{ctx.sizes.max_examples}, checks=[check])` for each check, kernel and dtype: the spec "
        "narrowed to that dtype, its factory returning one kernel instance per kernel (as the "
        "resolver keeps one per process); case space "
        f"{ctx.sizes.case_space or 'the kit default'}."
    )
    for name in kernel_names(ctx):
        missing = missing_packages(ctx, name)
        if missing:
            row = {"kernel": name, "dtype": "-"}
            row["status"] = f"skipped: {', '.join(missing)} not importable"
            add_row(ctx, section, row)
            continue
        spec = ctx.resolver.specs[name]
        instance: list[object] = []  # built at the first check that runs

        def factory(spec: Any = spec, instance: list[object] = instance) -> object:
            if not instance:
                instance.append(spec.factory())
            return instance[0]

        for dtype in DTYPES:
            row: dict[str, Any] = {"kernel": name, "dtype": dtype_name(dtype)}
            narrowed = restricted(spec, ctx.device_type, dtype)
            if narrowed is None:
                row["status"] = f"skipped: declares no {dtype_name(dtype)} on {ctx.device_type}"
                add_row(ctx, section, row)
                continue
            why = reasons(ctx, name, dtype, backward=False)
            if why:
                row["status"] = "skipped: " + "; ".join(why)
                add_row(ctx, section, row)
                continue
            narrowed = attrs.evolve(narrowed, factory=factory)
            row.update(_conformance_row(ctx, section, narrowed, check_kernel, CHECKS, space))
            add_row(ctx, section, row)


def _conformance_row(
    ctx: Context,
    section: Section,
    spec: Any,
    check_kernel: Callable[..., Any],
    checks: Sequence[str],
    space: Any,
) -> dict[str, Any]:
    """One kernel and dtype through every check, one check at a time (the budget is looked at
    between checks); stops at the first failing check."""
    from ringdilated.testing.conformance import ConformanceError

    start = time.perf_counter()
    passed: list[str] = []
    not_applicable: list[str] = []
    row: dict[str, Any] = {}
    label = f"{spec.name} {dtype_name(next(iter(_device_dtypes(spec, ctx.device_type))))}"
    try:
        spec.factory()  # one instance per kernel, shared by its checks
    except Exception as exc:  # as the resolver records it: a reason, the kernel unavailable
        row["status"] = f"unavailable: the factory raised {chain(exc)}"
        return row
    for check in checks:
        if section.over_budget(f"{label} {check}"):
            row["status"] = "partial"
            break
        try:
            report = check_kernel(
                spec,
                device=ctx.device_type,
                max_examples=ctx.sizes.max_examples,
                checks=[check],
                space=space,
            )
        except ConformanceError as exc:
            row.update(status="FAIL", check=exc.check, message=first_line(exc, 400))
            row["_message"] = str(exc)
            break
        except Exception as exc:
            row.update(
                status="error", check=check, message=f"{type(exc).__name__}: {first_line(exc)}"
            )
            row["_traceback"] = traceback.format_exc()
            break
        passed += report.passed
        not_applicable += report.not_applicable
    else:
        row["status"] = "pass"
    row["checks passed"] = ", ".join(passed) or "-"
    row["not applicable"] = ", ".join(not_applicable) or "-"
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def _device_dtypes(spec: Any, device_type: str) -> set[torch.dtype]:
    return {d for t in _targets(spec) if t.device_type == device_type for d in t.dtypes}


# --------------------------------------------------------------------------------------------
# 3. Oracle comparison


@dataclass(frozen=True)
class OracleCase:
    mode: str
    causal: bool
    variant: str  # plain, gqa, documents (a layout, GQA heads), padding (key_padding_mask)

    def label(self) -> str:
        return f"{self.mode}, {'causal' if self.causal else 'full'}, {self.variant}"


def oracle_cases(count: int | None) -> list[OracleCase]:
    """Every combination of mode, causal and variant (``count=None``), or the first ``count``
    of a list that covers each mode, causal or not, and each variant within its first four."""
    if count is None:
        return [
            OracleCase(mode, causal, variant)
            for variant in ("plain", "gqa", "documents", "padding")
            for mode in ("head_groups", "longnet")
            for causal in (False, True)
        ]
    covering = [
        OracleCase("head_groups", False, "plain"),
        OracleCase("longnet", True, "gqa"),
        OracleCase("head_groups", True, "documents"),
        OracleCase("longnet", False, "padding"),
        OracleCase("longnet", False, "documents"),
        OracleCase("head_groups", True, "padding"),
    ]
    return covering[:count]


def padding_mask(batch: int, length: int, pads: Sequence[int], device: torch.device) -> Any:
    """``(batch, length)`` bool, ``True`` = padding: row 0 padded on the right, row 1 on the
    left, further rows alternating."""
    mask = torch.zeros(batch, length, dtype=torch.bool)
    for b in range(batch):
        pad = pads[b % len(pads)]
        if b % 2 == 0:
            mask[b, length - pad :] = True
        else:
            mask[b, :pad] = True
    return mask.to(device)


def section_oracle(ctx: Context, section: Section) -> None:
    if not ctx.cuda and ctx.device_type == "cuda":
        add_row(ctx, section, {"kernel": "-", "status": NO_CUDA})
        return
    s = ctx.sizes.oracle
    oracle_device = ctx.device  # float64 on the GPU itself, else on the CPU
    section.notes.append(
        f"B={s['batch']}, L={s['length']}, H={s['heads']} (GQA: {s['kv_heads']} key/value heads), "
        f"D={s['head_dim']}, segments {s['segments']}, rates {s['rates']}; documents: a "
        f"SequenceLayout with cu_seqlens {s['cu_seqlens']} (GQA heads); padding: "
        f"key_padding_mask, row 0 right-padded by {s['padding'][0]}, row 1 left-padded by "
        f"{s['padding'][1]}. Each cell is `max error / allowed` against the float64 oracle "
        f"(on {oracle_device.type}); allowed = 2 x the dense baseline's error in the same dtype "
        "+ floor (`allowed_error`). Gradients are of `out` against a random `dout`."
    )
    names = [n for n in kernel_names(ctx) if not missing_packages(ctx, n)]
    for n, why in ctx.sizes.oracle_leave_out.items():
        if n in names:
            names.remove(n)
            add_row(ctx, section, {"kernel": n, "status": f"skipped: {why}"})
    for n in kernel_names(ctx):
        if missing_packages(ctx, n):
            add_row(
                ctx,
                section,
                {"kernel": n, "status": f"skipped: {', '.join(missing_packages(ctx, n))} "
                 "not importable"},
            )  # fmt: skip
    seed = 0
    skipped: dict[tuple[str, str, str], int] = {}
    for dtype in DTYPES:
        for case in oracle_cases(ctx.sizes.oracle_cases):
            seed += 1
            label = f"{dtype_name(dtype)} {case.label()}"
            if section.over_budget(label):
                continue
            try:
                truth = _oracle_truth(ctx, case, dtype, seed, oracle_device)
            except Exception as exc:
                add_row(
                    ctx,
                    section,
                    {
                        "kernel": "(oracle)",
                        "dtype": dtype_name(dtype),
                        "case": case.label(),
                        "status": "error",
                        "message": f"{type(exc).__name__}: {first_line(exc)}",
                        "_traceback": traceback.format_exc(),
                    },
                )
                continue
            for name in names:
                row = _oracle_row(ctx, name, case, dtype, truth)
                key = (name, row["dtype"], row["status"])
                if row["status"].startswith(("skipped", "unavailable")) and key in skipped:
                    skipped[key] += 1  # listed once per kernel, dtype and reason
                    continue
                skipped[key] = 0
                add_row(ctx, section, row)
    repeats = sum(skipped.values())
    if repeats:
        section.notes.append(
            f"{repeats} further cases skipped for a reason already listed for their kernel and "
            "dtype (not repeated above)."
        )


def _oracle_truth(
    ctx: Context, case: OracleCase, dtype: torch.dtype, seed: int, oracle_device: torch.device
) -> dict[str, Any]:
    """The inputs in ``dtype``, and the float64 oracle and dense baseline on them."""
    s = ctx.sizes.oracle
    g = torch.Generator().manual_seed(seed)
    heads = s["heads"]
    kv_heads = s["kv_heads"] if case.variant in ("gqa", "documents") else heads
    shape_q = (s["batch"], s["length"], heads, s["head_dim"])
    shape_kv = (s["batch"], s["length"], kv_heads, s["head_dim"])
    raw = [torch.randn(shape, generator=g, dtype=torch.float64) for shape in (shape_q, shape_kv)]
    raw.append(torch.randn(shape_kv, generator=g, dtype=torch.float64))
    inputs = [x.to(ctx.device, dtype) for x in raw]
    dout = torch.randn(shape_q, generator=g, dtype=torch.float64).to(ctx.device, dtype)
    kw: dict[str, Any] = {"mode": case.mode, "causal": case.causal}
    call_kw: dict[str, Any] = {}
    if case.variant == "documents":
        cu = torch.tensor(s["cu_seqlens"])
        kw["cu_seqlens"] = cu
        call_kw["layout"] = ringdilated.SequenceLayout(cu_seqlens=cu)
    elif case.variant == "padding":
        mask = padding_mask(s["batch"], s["length"], s["padding"], ctx.device)
        kw["key_padding_mask"] = mask
        call_kw["key_padding_mask"] = mask
    seg, rates = s["segments"], s["rates"]
    exact = [x.detach().to(oracle_device, torch.float64).requires_grad_() for x in inputs]
    oracle_kw = dict(kw)
    if "key_padding_mask" in oracle_kw:
        oracle_kw["key_padding_mask"] = oracle_kw["key_padding_mask"].to(oracle_device)
    out64, lse64 = oracle(*exact, seg, rates, return_lse=True, **oracle_kw)
    grads64 = torch.autograd.grad(out64, exact, dout.to(oracle_device, torch.float64))
    base = [x.detach().clone().requires_grad_() for x in inputs]
    bout, blse = dense_attention(*base, seg, rates, **kw)
    bgrads = torch.autograd.grad(bout, base, dout)
    return {
        "inputs": inputs,
        "dout": dout,
        "call_kw": call_kw,
        "kw": {"mode": case.mode, "causal": case.causal},
        "expected": {
            "out": out64,
            "lse": lse64,
            **dict(zip(("dq", "dk", "dv"), grads64, strict=True)),
        },
        "baseline": {
            "out": bout,
            "lse": blse,
            **dict(zip(("dq", "dk", "dv"), bgrads, strict=True)),
        },
        "gqa": kv_heads != heads,
    }


def _oracle_row(
    ctx: Context, name: str, case: OracleCase, dtype: torch.dtype, truth: dict[str, Any]
) -> dict[str, Any]:
    s = ctx.sizes.oracle
    row: dict[str, Any] = {"kernel": name, "dtype": dtype_name(dtype), "case": case.label()}
    common = {"head_dim": s["head_dim"], "window": case.causal, "gqa": truth["gqa"]}
    backward_reasons = reasons(ctx, name, dtype, backward=True, **common)
    forward_reasons = reasons(ctx, name, dtype, backward=False, **common)
    if forward_reasons:
        row["status"] = "skipped: " + "; ".join(forward_reasons)
        return row
    backward = not backward_reasons
    if not backward:
        row["note"] = "forward only: " + "; ".join(backward_reasons)
    seg, rates = s["segments"], s["rates"]
    try:
        x = [t.detach().clone().requires_grad_(backward) for t in truth["inputs"]]
        out, lse = ringdilated.dilated_attention(
            *x,
            seg,
            rates,
            kernel=name,
            return_lse=True,
            **truth["kw"],
            **truth["call_kw"],
        )
        actual = {"out": out, "lse": lse}
        if backward:
            grads = torch.autograd.grad(out, x, truth["dout"])
            actual.update(zip(("dq", "dk", "dv"), grads, strict=True))
        ctx.synchronize()
        worst = 0.0
        for what, value in actual.items():
            expected = truth["expected"][what]
            error = max_error(value, expected)
            allowed = allowed_error(expected, truth["baseline"][what], dtype)
            row[what] = f"{error:.2e} / {allowed:.2e}"
            row[f"_{what}"] = {"error": error, "allowed": allowed}
            worst = max(worst, error / allowed if allowed > 0 else math.inf)
        row["worst error/allowed"] = round(worst, 3)
        row["status"] = "pass" if worst <= 1.0 else "FAIL"
    except Exception as exc:
        record_failure(row, exc)
    return row


# --------------------------------------------------------------------------------------------
# 4. No host sync in planned layer calls


@dataclass
class LayerCase:
    """A planned layer call: the module, its inputs and the layout (``None``: no layout)."""

    label: str
    kernel: str
    layout_name: str
    module: torch.nn.Module
    inputs: list[torch.Tensor]
    layout: Any
    kind: str  # "qkv" (DilatedAttention) or "mha" (MultiheadDilatedAttention)

    def call(self, inputs: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        args = list(self.inputs if inputs is None else inputs)
        kw = {} if self.layout is None else {"layout": self.layout}
        if self.kind == "mha":
            out, _ = self.module(args[0], args[0], args[0], **kw)
            return out
        return self.module(*args, **kw)


def layer_layouts(ctx: Context) -> dict[str, Any]:
    s = ctx.sizes.layer
    return {
        "none": None,
        "documents": lambda: ringdilated.SequenceLayout(cu_seqlens=torch.tensor(s["cu_seqlens"])),
        "padding": lambda: ringdilated.SequenceLayout(
            key_padding_mask=padding_mask(s["batch"], s["length"], s["padding"], ctx.device)
        ),
    }


def layer_cases(
    ctx: Context, dtype: torch.dtype, backward: bool, layouts: Sequence[str]
) -> Iterator[LayerCase | dict[str, Any]]:
    """``DilatedAttention`` per kernel serving the request and layout, then
    ``MultiheadDilatedAttention`` (the resolver's choice) per layout but ``none``; a dict where a
    kernel does not serve (a skipped row)."""
    s = ctx.sizes.layer
    makers = layer_layouts(ctx)
    g = torch.Generator().manual_seed(7)
    B, L, H, Hkv, D = s["batch"], s["length"], s["heads"], s["kv_heads"], s["head_dim"]

    def tensor(*shape: int) -> torch.Tensor:
        x = torch.randn(shape, generator=g, dtype=torch.float64).to(ctx.device, dtype)
        return x.requires_grad_(backward)

    kw = {"segment_lengths": s["segments"], "dilation_rates": s["rates"], "causal": True}
    for name in kernel_names(ctx):
        why = reasons(ctx, name, dtype, backward=backward, head_dim=D, window=True, gqa=True)
        if missing_packages(ctx, name) or why:
            why = why or tuple(f"{p} not importable" for p in missing_packages(ctx, name))
            yield {
                "layer": "DilatedAttention",
                "kernel": name,
                "status": "skipped: " + "; ".join(why),
            }
            continue
        for layout_name in layouts:
            make = makers[layout_name]
            module = ringdilated.DilatedAttention(
                s["segments"], s["rates"], causal=True, kernel=name
            )
            yield LayerCase(
                f"DilatedAttention {name} {layout_name}",
                name,
                layout_name,
                module,
                [tensor(B, L, H, D), tensor(B, L, Hkv, D), tensor(B, L, Hkv, D)],
                None if make is None else make(),
                "qkv",
            )
    for layout_name in layouts:
        make = makers[layout_name]
        if make is None:
            continue
        mha = ringdilated.MultiheadDilatedAttention(
            H * D, H, num_kv_heads=Hkv, device=ctx.device, dtype=dtype, **kw
        )
        mha.requires_grad_(backward)
        yield LayerCase(
            f"MultiheadDilatedAttention auto {layout_name}",
            "auto",
            layout_name,
            mha,
            [tensor(B, L, H * D)],
            make(),
            "mha",
        )


def _forward_backward(case: LayerCase, dout: torch.Tensor) -> None:
    out = case.call()
    params = [p for p in case.module.parameters() if p.requires_grad]
    torch.autograd.grad(out, [*case.inputs, *params], dout)


def _offender(exc: BaseException) -> str:
    """The innermost frame of ringdilated (else the innermost) in ``exc``'s traceback."""
    frames = traceback.extract_tb(exc.__traceback__)
    package = os.path.realpath(Path(ringdilated.__file__).parent) + os.sep
    ours = [f for f in frames if os.path.realpath(f.filename).startswith(package)]
    frame = (ours or frames or [None])[-1]
    where = (
        "?" if frame is None else f"{frame.filename}:{frame.lineno} ({frame.name}): {frame.line}"
    )
    return f"{type(exc).__name__}: {first_line(exc, 160)} at {where}"


def section_hot_path(ctx: Context, section: Section) -> None:
    if not ctx.cuda and ctx.device_type == "cuda":
        add_row(ctx, section, {"layer": "-", "status": NO_CUDA})
        return
    s = ctx.sizes.layer
    dtype = ctx.fast_dtype() if ctx.cuda else torch.float32
    section.notes.append(
        f"{dtype_name(dtype)}, B={s['batch']}, L={s['length']}, H={s['heads']}, "
        f"Hkv={s['kv_heads']}, D={s['head_dim']}, causal, segments {s['segments']}, rates "
        f"{s['rates']}. Per row: one forward+backward that plans, then one under "
        '`torch.cuda.set_sync_debug_mode("error")` (the previous mode restored after), then one '
        "counted by `HotPathCounter` (host reads, copies from Python data, control "
        "collectives); both must be 0. Layouts: none (a plain call), documents "
        f"(cu_seqlens {s['cu_seqlens']}), padding (key_padding_mask)."
    )
    if not ctx.cuda:
        section.notes.append(f"sync debug mode: {NO_CUDA}; the counter still runs.")
    for case in layer_cases(ctx, dtype, True, ("none", "documents", "padding")):
        if isinstance(case, dict):
            add_row(ctx, section, case)
            continue
        if section.over_budget(case.label):
            continue
        row: dict[str, Any] = {"layer": case.label.split()[0], "kernel": case.kernel}
        row["layout"] = case.layout_name
        try:
            g = torch.Generator().manual_seed(11)
            shape = case.inputs[0].shape
            dout = torch.randn(shape, generator=g, dtype=torch.float64).to(ctx.device, dtype)
            _forward_backward(case, dout)  # the first call plans
            ctx.synchronize()
            row["sync debug"] = _sync_debug(ctx, case, dout)
            with HotPathCounter() as counts:
                _forward_backward(case, dout)
            ctx.synchronize()
            row["host reads"] = counts.host_reads
            row["host copies"] = counts.host_copies
            row["control collectives"] = counts.control_collectives
            row["first counted"] = counts.events[0][1] if counts.events else "-"
            row["_events"] = counts.events[:50]
            sync_ok = row["sync debug"] in ("pass", NO_CUDA)
            row["status"] = "pass" if sync_ok and counts.host_traffic == 0 else "FAIL"
        except Exception as exc:
            record_failure(row, exc)
        add_row(ctx, section, row)


def _sync_debug(ctx: Context, case: LayerCase, dout: torch.Tensor) -> str:
    if not ctx.cuda:
        return NO_CUDA
    previous = torch.cuda.get_sync_debug_mode()
    failure: RuntimeError | None = None
    torch.cuda.set_sync_debug_mode("error")
    try:
        _forward_backward(case, dout)
    except RuntimeError as exc:  # "called a synchronizing CUDA operation", or a real error
        failure = exc
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
    if failure is None:
        return "pass"
    return "FAIL: " + _offender(failure) + _all_syncs(case, dout)


def _all_syncs(case: LayerCase, dout: torch.Tensor) -> str:
    """Every synchronising op of one more call, from sync debug mode ``warn``."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            _forward_backward(case, dout)
        except Exception as exc:
            return f"; the warn-mode call raised {type(exc).__name__}: {first_line(exc, 120)}"
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    places = []
    for w in caught:
        if "synchroniz" in str(w.message):
            place = f"{w.filename}:{w.lineno}"
            if place not in places:
                places.append(place)
    return f"; every sync (warn mode): {', '.join(places[:8]) or 'none seen'}"


# --------------------------------------------------------------------------------------------
# 5. CUDA graphs


def section_graphs(ctx: Context, section: Section) -> None:
    if not ctx.cuda:
        add_row(ctx, section, {"layer": "-", "status": NO_CUDA})
        return
    dtype = ctx.fast_dtype()
    s = ctx.sizes.layer
    section.notes.append(
        f"{dtype_name(dtype)}, B={s['batch']}, L={s['length']}, H={s['heads']}, "
        f"Hkv={s['kv_heads']}, D={s['head_dim']}, causal, forward under no_grad. Per row: a "
        "planning call, 3 warm-up calls on a side stream, capture with `torch.cuda.graph`, "
        "then twice: new values copied into the static inputs, `replay()`, and the output "
        "compared with an eager call on the same values (pass: equal within the dtype's floor, "
        "`FLOORS[dtype] * max(1, max|eager|)`; `exact` says whether bit-identical)."
    )
    with torch.no_grad():
        for case in layer_cases(ctx, dtype, False, ("none", "documents", "padding")):
            if isinstance(case, dict):
                add_row(ctx, section, case)
                continue
            if section.over_budget(case.label):
                continue
            add_row(ctx, section, _graph_row(ctx, case, dtype))


def _graph_row(ctx: Context, case: LayerCase, dtype: torch.dtype) -> dict[str, Any]:
    row: dict[str, Any] = {"layer": case.label.split()[0], "kernel": case.kernel}
    row["layout"] = case.layout_name
    stage = "planning call"
    try:
        case.call()  # plans
        torch.cuda.synchronize()
        stage = "warm-up on a side stream"
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                case.call()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        stage = "capture"
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = case.call()
        torch.cuda.synchronize()
        stage = "replay"
        worst = 0.0
        exact = True
        previous: torch.Tensor | None = None
        for seed in (101, 202):
            g = torch.Generator().manual_seed(seed)
            fresh = [
                torch.randn(x.shape, generator=g, dtype=torch.float64).to(ctx.device, dtype)
                for x in case.inputs
            ]
            for static, value in zip(case.inputs, fresh, strict=True):
                static.copy_(value)
            graph.replay()
            torch.cuda.synchronize()
            replayed = static_out.clone()
            eager = case.call(fresh)
            torch.cuda.synchronize()
            error = max_error(replayed, eager)
            floor = FLOORS[dtype] * max(1.0, float(eager.detach().abs().amax().double()))
            worst = max(worst, error / floor)
            exact = exact and torch.equal(replayed, eager)
            if previous is not None and torch.equal(previous, replayed):
                raise AssertionError("two replays with different inputs gave the same output")
            previous = replayed
        row["max error / floor"] = round(worst, 4)
        row["exact"] = exact
        row["status"] = "pass" if worst <= 1.0 else "FAIL"
    except Exception as exc:
        row["stage"] = stage
        record_failure(row, exc, "FAIL" if stage in ("capture", "replay") else "error")
        with _quiet():
            try:
                torch.cuda.synchronize()
            except Exception as sync_error:  # a capture left broken: say so, go on
                row["message"] += f"; then synchronize raised {first_line(sync_error, 120)}"
    return row


# --------------------------------------------------------------------------------------------
# 6. Throughput


def _time(ctx: Context, fn: Callable[[], object], warmup: int, repeats: int) -> list[float]:
    """Seconds per call: CUDA events on CUDA, ``perf_counter`` on CPU; after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    ctx.synchronize()
    times = []
    for _ in range(repeats):
        if ctx.cuda:
            start = torch.cuda.Event(enable_timing=True)
            stop = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def section_throughput(ctx: Context, section: Section) -> None:
    if not ctx.cuda and ctx.device_type == "cuda":
        add_row(ctx, section, {"L": "-", "status": NO_CUDA})
        return
    b = ctx.sizes.bench
    dtype = ctx.fast_dtype()
    B, H, D = b["batch"], b["heads"], b["head_dim"]
    pattern = ringdilated.DilationPattern(b["segments"], b["rates"], "head_groups")
    section.notes.append(
        f"{dtype_name(dtype)}, B={B}, H={H}, D={D}, head_groups, segments {b['segments']}, "
        f"rates {b['rates']}; median of {b['repeats']} timed calls after {b['warmup']} warm-up "
        f"({'CUDA events' if ctx.cuda else 'perf_counter'}). Pattern FLOPs from "
        "`DilationPattern.flops` (selected pairs only, causal: on or below the diagonal); dense "
        "FLOPs `4 L^2 D H B`, halved when causal. Forward+backward counts 3.5x the forward "
        "(backward = 2.5x, FlashAttention's convention). Forward timed under no_grad. Dense: "
        "`F.scaled_dot_product_attention` inside `sdpa_kernel(SDPBackend.FLASH_ATTENTION)`. "
        "`vs dense` = dense time / this row's time at the same L, causal and pass."
    )
    kernels = []
    for name in kernel_names(ctx, FAST_KERNELS):
        why = reasons(ctx, name, dtype, backward=False, head_dim=D, window=True)
        missing = missing_packages(ctx, name)
        if missing or why:
            text = "; ".join(why) or f"{', '.join(missing)} not importable"
            add_row(ctx, section, {"kernel": name, "status": f"skipped: {text}"})
        else:
            kernels.append(name)
    for length in b["lengths"]:
        for causal in (False, True):
            dense_times: dict[str, float] = {}
            runners: list[tuple[str, Callable[[bool], tuple[Callable[[], object], int]]]] = []
            runners.append(
                ("dense sdpa (flash)", _dense_runner(ctx, B, length, H, D, dtype, causal))
            )
            runners += [
                (name, _dilated_runner(ctx, name, pattern, B, length, H, D, dtype, causal))
                for name in kernels
            ]
            for name, make in runners:
                for backward in (False, True):
                    label = f"L={length} {'causal' if causal else 'full'} {name}"
                    label += " fwd+bwd" if backward else " fwd"
                    if section.over_budget(label):
                        continue
                    row: dict[str, Any] = {"L": length, "causal": causal, "kernel": name}
                    row["pass"] = "fwd+bwd" if backward else "fwd"
                    if name != "dense sdpa (flash)":
                        backward_why = reasons(
                            ctx, name, dtype, backward=True, head_dim=D, window=causal
                        )
                        if backward and backward_why:
                            row["status"] = "skipped: " + "; ".join(backward_why)
                            add_row(ctx, section, row)
                            continue
                    try:
                        if ctx.cuda:
                            torch.cuda.empty_cache()
                            torch.cuda.reset_peak_memory_stats(ctx.device)
                        fn, flops = make(backward)
                        times = _time(ctx, fn, b["warmup"], b["repeats"])
                        median = statistics.median(times)
                        row["ms"] = median * 1e3
                        row["min-max ms"] = f"{min(times) * 1e3:.4g}-{max(times) * 1e3:.4g}"
                        row["TFLOP/s"] = flops / median / 1e12
                        row["GFLOP"] = flops / 1e9
                        if ctx.cuda:
                            peak = torch.cuda.max_memory_allocated(ctx.device)
                            row["peak GiB"] = peak / 2**30
                        key = row["pass"]
                        if name == "dense sdpa (flash)":
                            dense_times[key] = median
                        elif key in dense_times:
                            row["vs dense"] = dense_times[key] / median
                        row["_times"] = times
                        row["status"] = "pass"
                    except Exception as exc:
                        record_failure(row, exc)
                    add_row(ctx, section, row)


def _inputs(
    ctx: Context, B: int, L: int, H: int, D: int, dtype: torch.dtype, backward: bool, layout: str
) -> list[torch.Tensor]:
    g = torch.Generator(device=ctx.device).manual_seed(5)
    shape = (B, L, H, D) if layout == "BLHD" else (B, H, L, D)
    return [
        torch.randn(shape, generator=g, device=ctx.device, dtype=dtype).requires_grad_(backward)
        for _ in range(3)
    ]


def _dense_runner(
    ctx: Context, B: int, L: int, H: int, D: int, dtype: torch.dtype, causal: bool
) -> Callable[[bool], tuple[Callable[[], object], int]]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    flops = 4 * L * L * D * H * B // (2 if causal else 1)

    def make(backward: bool) -> tuple[Callable[[], object], int]:
        q, k, v = _inputs(ctx, B, L, H, D, dtype, backward, "BHLD")
        dout = torch.randn_like(q)

        def forward() -> object:
            with torch.no_grad(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

        def forward_backward() -> object:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
            return torch.autograd.grad(out, (q, k, v), dout)

        return (forward_backward, int(3.5 * flops)) if backward else (forward, flops)

    return make


def _dilated_runner(
    ctx: Context,
    name: str,
    pattern: Any,
    B: int,
    L: int,
    H: int,
    D: int,
    dtype: torch.dtype,
    causal: bool,
) -> Callable[[bool], tuple[Callable[[], object], int]]:
    flops = pattern.flops(L, H, D, causal) * B

    def make(backward: bool) -> tuple[Callable[[], object], int]:
        q, k, v = _inputs(ctx, B, L, H, D, dtype, backward, "BLHD")
        dout = torch.randn_like(q)
        attn = ringdilated.DilatedAttention(
            list(pattern.segment_lengths),
            list(pattern.dilation_rates),
            mode=pattern.mode,
            causal=causal,
            kernel=name,
        )
        layout = ringdilated.SequenceLayout()

        def forward() -> object:
            with torch.no_grad():
                return attn(q, k, v, layout=layout)

        def forward_backward() -> object:
            out = attn(q, k, v, layout=layout)
            return torch.autograd.grad(out, (q, k, v), dout)

        return (forward_backward, int(3.5 * flops)) if backward else (forward, flops)

    return make


# --------------------------------------------------------------------------------------------


BODIES: dict[int, Callable[[Context, Section], None]] = {
    1: section_environment,
    2: section_conformance,
    3: section_oracle,
    4: section_hot_path,
    5: section_graphs,
    6: section_throughput,
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Run ringdilated's GPU check (issue 20, item 8) and write one report.",
    )
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer cases")
    parser.add_argument(
        "--report",
        type=Path,
        default=Path("gpu_check_report.md"),
        help="Markdown report path (a .json twin is written beside it)",
    )
    parser.add_argument(
        "--sections",
        default="1,2,3,4,5,6",
        help="comma-separated section numbers to run (default: all; the others are listed as "
        "not selected)",
    )
    parser.add_argument(
        "--kernels", default=None, help="comma-separated kernel names (default: every kernel)"
    )
    parser.add_argument(
        "--max-examples", type=int, default=None, help="hypothesis examples per conformance check"
    )
    parser.add_argument(
        "--budget-scale", type=float, default=1.0, help="multiply every section's time budget"
    )
    args = parser.parse_args(argv)
    try:
        args.sections = sorted({int(n) for n in args.sections.split(",") if n.strip()})
    except ValueError:
        parser.error(f"--sections takes numbers 1-6, got {args.sections!r}")
    if not set(args.sections) <= set(SECTIONS):
        parser.error(f"--sections takes numbers 1-6, got {args.sections}")
    if args.kernels is not None:
        args.kernels = [n.strip() for n in args.kernels.split(",") if n.strip()]
    if args.budget_scale <= 0:
        parser.error("--budget-scale must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type not in ("cuda", "cpu"):
        print(f"gpu_check: --device must be cuda, cuda:N or cpu, got {args.device!r}")
        return 2
    cuda = device.type == "cuda" and torch.cuda.is_available()
    if cuda:
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        name = f"{device}: {torch.cuda.get_device_name(device)}"
    else:
        name = "cpu" if device.type == "cpu" else f"{device}: no CUDA device"
    command = "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    report = Report(args.report, command, name)
    resolver = default_resolver()
    if args.kernels is not None:
        unknown = set(args.kernels) - set(resolver.specs)
        if unknown:
            print(f"gpu_check: unknown kernels {sorted(unknown)}; known: {sorted(resolver.specs)}")
            return 2
    ctx = Context(
        device=device,
        cuda=cuda,
        quick=args.quick,
        sizes=sizes_for(device.type, args.quick, args.max_examples),
        kernels=args.kernels,
        report=report,
        resolver=resolver,
        env=resolver.env if isinstance(resolver.env, Environment) else Environment(),
    )
    budgets = BUDGETS[(device.type, args.quick)]
    for number, title in SECTIONS.items():
        section = Section(number, title, budgets[number] * args.budget_scale)
        if number not in args.sections:
            section.status = "skipped"
            section.notes.append("not selected (--sections)")
            report.sections.append(section)
            continue
        run_section(ctx, section, BODIES[number])
    report.finished = datetime.datetime.now(datetime.timezone.utc)
    report.write()
    print()
    print(report.markdown())
    print(f"report: {report.path} (raw figures: {report.json_path})")
    for s in report.sections:
        print(f"  {s.number}. {s.title}: {s.status} ({s.seconds:.1f} s)")
    if device.type == "cuda" and not cuda:
        print("nothing was checked on cuda: no CUDA device")
        return 1
    return 1 if any(s.status in ("FAIL", "error") for s in report.sections) else 0


if __name__ == "__main__":
    sys.exit(main())
