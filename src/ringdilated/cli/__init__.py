"""The ``ringdilated`` command line (also ``python -m ringdilated``).

    ringdilated doctor     torch, devices, plugins and what the resolver would pick, with reasons
    ringdilated bench      the benchmark grid: table, JSON/CSV, optional plot, optional N ranks
    ringdilated verify     the conformance kits against every installed backend
    ringdilated demo       a 2-process check of the sharded result against one process

Errors print one line (``--debug``: the traceback too).
"""

from ringdilated.cli.main import main

__all__ = ["main"]
