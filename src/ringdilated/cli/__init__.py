"""The ``ringdilated`` command line (also ``python -m ringdilated``).

    ringdilated doctor     torch, devices, plugins and what the resolver would pick, with reasons
    ringdilated bench      the benchmark grid: table, JSON/CSV, optional plot, optional N ranks
    ringdilated verify     the conformance kits against every installed backend
    ringdilated demo       a 2-process check of the sharded result against one process

Every flag is checked before any work. Errors print one line: status 2 for a usage error (a flag
wrong on its own), 1 for anything else (``--debug``: the traceback instead). See docs/cli.md.
"""

from ringdilated.cli.main import main

__all__ = ["main"]
