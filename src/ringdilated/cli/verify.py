"""Run the conformance kits against every installed backend; non-zero exit unless all passed.

Kernels are checked on ``--device`` where they declare a target there (others are listed as
skipped, with why); distributed communicators on real gloo groups of ``--world-sizes`` ranks
(CPU only: on another device they are listed as skipped). The exit status is 1 when a backend
failed its checks, when one that declares ``--device`` could not run there (unavailable), and
when nothing at all was verified (no CUDA device for ``--device cuda``, say). Needs the test
extra (``pip install -e '.[test]'``).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from ringdilated.cli import flags
from ringdilated.cli.progress import progress, table

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device", type=flags.device_name, default="cpu", help="cpu or cuda (default: cpu)"
    )
    parser.add_argument(
        "--max-examples", type=flags.positive_int, default=10, help="hypothesis examples/check"
    )
    parser.add_argument(
        "--world-sizes",
        type=flags.int_list(minimum=2),
        default=[2, 4],
        help="gloo group sizes for communicators (each at least 2)",
    )
    parser.add_argument("--only", action="append", default=[], help="check only these backends")
    parser.add_argument("--no-progress", action="store_true")


def _kernel_row(name: str, spec: Any, args: argparse.Namespace) -> tuple[str, str, str]:
    from ringdilated.testing import ConformanceError, check_kernel

    devices = sorted({t.device_type for t in spec.capabilities.targets})
    if args.device not in devices:
        return ("skipped", f"declares no {args.device} target ({', '.join(devices)})", "")
    try:
        report = check_kernel(name, device=args.device, max_examples=args.max_examples)
    except ConformanceError as exc:
        return ("FAIL", str(exc).splitlines()[0][:160], "")
    except Exception as exc:  # a backend that cannot even start is reported, not fatal
        return ("unavailable", f"{type(exc).__name__}: {str(exc).splitlines()[0][:140]}", "")
    na = f"n/a: {', '.join(report.not_applicable)}" if report.not_applicable else ""
    return ("pass", ", ".join(report.passed), na)


def _communicator_row(
    name: str, spec: Any, pools: dict[int, Any], args: argparse.Namespace
) -> tuple[str, str, str]:
    from ringdilated.testing import ConformanceError, check_communicator

    if not spec.distributed:
        return ("skipped", "serves one process (every kernel check exercises it)", "")
    if args.device != "cpu":
        return ("skipped", "checked on gloo (CPU) groups: run with --device cpu", "")
    try:
        report = check_communicator(
            name, world_sizes=args.world_sizes, pools=pools, max_examples=args.max_examples
        )
    except ConformanceError as exc:
        return ("FAIL", str(exc).splitlines()[0][:160], "")
    runs = ", ".join(
        f"{w} ranks: {n} problem{'s' if n != 1 else ''}"
        for w, n in zip(report.world_sizes, report.problems, strict=True)
    )
    return ("pass", "matches-local", runs)


def run(args: argparse.Namespace) -> int:
    try:
        import hypothesis  # noqa: F401
    except ModuleNotFoundError:
        raise RuntimeError("verify needs the test extra: pip install -e '.[test]'") from None
    from ringdilated.registry import default_resolver

    resolver = default_resolver()
    backends: list[tuple[str, str, Any]] = [("kernel", *i) for i in sorted(resolver.specs.items())]
    backends += [("communicator", *i) for i in sorted(resolver.communicator_specs.items())]
    unknown = set(args.only) - {name for _, name, _ in backends}
    if unknown:
        raise ValueError(f"--only names unknown backends: {', '.join(sorted(unknown))}")
    if args.only:
        backends = [b for b in backends if b[1] in args.only]
    problem = flags.device_problem(args.device)
    if problem is not None:
        print(f"nothing was verified: {problem}")
        return 1
    args.device = torch.device(args.device).type  # targets are declared per device type
    from ringdilated.pool import Workers

    pools: dict[int, Any] = {}
    rows = []
    labels = [f"{kind} {name}" for kind, name, _ in backends]
    try:
        for label in progress(labels, "verify", enabled=not args.no_progress):
            kind, name, spec = backends[labels.index(label)]
            if kind == "kernel":
                rows.append((kind, name, *_kernel_row(name, spec, args)))
                continue
            if spec.distributed and args.device == "cpu":
                for size in args.world_sizes:
                    if size not in pools:
                        pools[size] = Workers(size)
            rows.append((kind, name, *_communicator_row(name, spec, pools, args)))
    finally:
        for pool in pools.values():
            pool.close()
    print(table(rows, ["kind", "backend", "result", "checks", "notes"]))
    counts = {r: sum(1 for row in rows if row[2] == r) for r in ("pass", "FAIL", "unavailable")}
    skipped = len(rows) - sum(counts.values())
    print(
        f"\non {args.device}: {counts['pass']} passed, {counts['FAIL']} failed, "
        f"{counts['unavailable']} unavailable, {skipped} skipped"
    )
    if not counts["pass"]:
        print(f"nothing was verified on {args.device}")
        return 1
    return 1 if counts["FAIL"] or counts["unavailable"] else 0
