"""Argument parsing and error handling for the ``ringdilated`` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ringdilated.cli import bench, demo, doctor, verify
from ringdilated.cli.flags import Parser
from ringdilated.core.support.errors import RingDilatedError

__all__ = ["CommandError", "build_parser", "main"]

COMMANDS = (doctor, bench, verify, demo)


class CommandError(RingDilatedError):
    """A command failed in a way the user can fix; printed as one line."""


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="ringdilated",
        description="Exact dilated attention on pluggable kernels, one process or many.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS:
        name = module.__name__.rsplit(".", 1)[1]
        doc = (module.__doc__ or "").strip()
        summary = doc.splitlines()[0] if doc else name
        sub = commands.add_parser(name, help=summary, description=doc)
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 failure).

    A usage error (an unknown flag, or a flag value that is wrong on its own) is printed as one
    line by :class:`~ringdilated.cli.flags.Parser` and raises ``SystemExit(2)``; any other error
    is printed as one line ``ringdilated COMMAND: error: Type: message`` and returns 1.
    """
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # reported by the command's parser, so the line names the command
        Parser(prog=f"{parser.prog} {args.command}").error(
            f"unrecognized arguments: {' '.join(extra)}"
        )
    try:
        status: int = args.run(args)
    except KeyboardInterrupt:
        print("ringdilated: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # the one-line report is the point: any failure lands here
        if args.debug:
            raise
        message = str(exc).splitlines()[0] if str(exc) else ""
        print(
            f"ringdilated {args.command}: error: {type(exc).__name__}: {message}", file=sys.stderr
        )
        return 1
    return status
