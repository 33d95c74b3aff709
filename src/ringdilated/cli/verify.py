"""Run the conformance kits against every installed backend; non-zero exit on any failure.

Kernels are checked on ``--device`` where they declare a target there (others are listed as
skipped, with why); distributed communicators on real gloo groups of ``--world-sizes`` ranks.
Needs the test extra (``pip install 'ringdilated[test]'``).
"""

from __future__ import annotations

import argparse
from typing import Any

from ringdilated.cli.progress import progress, table

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-examples", type=int, default=10, help="hypothesis examples/check")
    parser.add_argument("--world-sizes", default="2,4", help="gloo group sizes for communicators")
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
    name: str, spec: Any, sizes: list[int], pools: dict[int, Any], args: Any
) -> tuple[str, str, str]:
    from ringdilated.testing import ConformanceError, check_communicator

    if not spec.distributed:
        return ("skipped", "serves one process (every kernel check exercises it)", "")
    try:
        report = check_communicator(
            name, world_sizes=sizes, pools=pools, max_examples=args.max_examples
        )
    except ConformanceError as exc:
        return ("FAIL", str(exc).splitlines()[0][:160], "")
    runs = ", ".join(
        f"{w} ranks: {n} problems" for w, n in zip(report.world_sizes, report.problems, strict=True)
    )
    return ("pass", "matches-local", runs)


def run(args: argparse.Namespace) -> int:
    try:
        import hypothesis  # noqa: F401
    except ModuleNotFoundError:
        raise RuntimeError("verify needs the test extra: pip install 'ringdilated[test]'") from None
    from ringdilated.functional import default_resolver
    from ringdilated.testing.workers import Workers

    sizes = [int(x) for x in args.world_sizes.split(",") if x.strip()]
    resolver = default_resolver()
    backends: list[tuple[str, str, Any]] = [
        ("kernel", n, s) for n, s in sorted(resolver.specs.items())
    ]
    backends += [("communicator", n, s) for n, s in sorted(resolver.communicator_specs.items())]
    unknown = set(args.only) - {name for _, name, _ in backends}
    if unknown:
        raise ValueError(f"--only names unknown backends: {', '.join(sorted(unknown))}")
    if args.only:
        backends = [b for b in backends if b[1] in args.only]
    pools: dict[int, Any] = {}
    rows = []
    try:
        for kind, name, spec in progress(backends, "verify", enabled=not args.no_progress):
            if kind == "kernel":
                rows.append((kind, name, *_kernel_row(name, spec, args)))
                continue
            if spec.distributed:
                for size in sizes:
                    pools.setdefault(size, Workers(size))
            rows.append((kind, name, *_communicator_row(name, spec, sizes, pools, args)))
    finally:
        for pool in pools.values():
            pool.close()
    print(table(rows, ["kind", "backend", "result", "checks", "notes"]))
    failed = [r for r in rows if r[2] == "FAIL"]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} backends without failures")
    return 1 if failed else 0
