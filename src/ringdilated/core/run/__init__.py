"""Layer 4, execution: running a planned call's kernels and exchanges, forward and backward.

The single-process run (:mod:`.local`), the sharded run over a communicator (:mod:`.sharded`),
head parallelism (:mod:`.head_parallel`), the exchange of pieces (:mod:`.exchange`) and their
wire format (:mod:`.wire`), and attention sinks merged into a call's final results
(:mod:`.sinks`). No validation and no agreement happen here: a run receives a plan
that was checked and agreed. Imports only the layers below.
"""

from ringdilated.core.run.local import *  # noqa: F403
from ringdilated.core.run.local import first_order_only as first_order_only
from ringdilated.core.run.sinks import *  # noqa: F403
