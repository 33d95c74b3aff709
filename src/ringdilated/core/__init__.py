"""The engine, in layers, and the surface a backend is written against.

``core/`` imports torch and attrs only, never a backend, a plugin or the face. Its folders are
layers, each importing only those below it (``tests/test_layers.py`` holds it to that)::

    support   environment variables, warning locations, opaque objects
    plan      pattern, key window, documents and padding, shard plans,     (host arithmetic)
              head dealing
    contract  Kernel, Communicator, the accumulator, bottom-right pieces, the kernel guard
    select    capabilities and specs, the resolver, the cost model, the dtype policy
    run       the single-process and sharded runs, head parallelism, the exchange, the wire
    call      validation, the agreement, process layouts, the SequenceLayout, prepare_call

A backend imports what it needs from here (the names below); ``docs/plugins.md`` is the guide
and ``docs/architecture.md`` draws the layers. The flat module paths of 0.1
(``ringdilated.core.kernel``, ...) still import, with a ``DeprecationWarning``, for one release.
"""

from ringdilated.core import _aliases
from ringdilated.core.contract.accumulator import Accumulator, accumulation_dtype, merge_partials
from ringdilated.core.contract.causal import (
    BottomRightKernel,
    BottomRightPiece,
    backward_by_piece,
    backward_in_pieces,
    backward_with_lse_by_piece,
    bottom_right_pieces,
    forward_by_piece,
    forward_in_pieces,
    piece_seed,
)
from ringdilated.core.contract.communicator import (
    Communicator,
    Pending,
    TransferStats,
    every_peer_at_once,
    process_group,
)
from ringdilated.core.contract.kernel import (
    BlockOptions,
    Kernel,
    LseGradientKernel,
    mark_non_finite_problems,
    mark_non_finite_rows,
)
from ringdilated.core.plan.pattern import MODES, Block, DilationPattern, HeadRun, Mode, Selection
from ringdilated.core.plan.shards import ShardPlan
from ringdilated.core.plan.window import CAUSAL, FULL, KeyWindow
from ringdilated.core.select.capabilities import (
    FUSED_GRID_LIMIT,
    FUSED_QUERY_ELEMENTS,
    FUSED_WINDOWED_GRID_LIMIT,
    GRID_LIMIT,
    BatchLimit,
    Capabilities,
    Environment,
    KernelSpec,
    PriorityRule,
    Request,
    Target,
    deterministic_algorithms,
)
from ringdilated.core.select.communicator_spec import CommunicatorSpec
from ringdilated.core.select.resolver import KERNEL_ENV_VAR, KernelChoice, Plan, Resolver
from ringdilated.core.support.errors import (
    AgreementError,
    CallMismatchError,
    CudaDeviceNotSetError,
    EveryRankError,
    KernelContractError,
    PeerRejectedError,
    ResolutionError,
    RingDilatedError,
    RingDilatedWarning,
)

_aliases.install()

__all__ = [
    "CAUSAL",
    "FULL",
    "FUSED_GRID_LIMIT",
    "FUSED_QUERY_ELEMENTS",
    "FUSED_WINDOWED_GRID_LIMIT",
    "GRID_LIMIT",
    "KERNEL_ENV_VAR",
    "MODES",
    "Accumulator",
    "AgreementError",
    "BatchLimit",
    "Block",
    "BlockOptions",
    "BottomRightKernel",
    "BottomRightPiece",
    "CallMismatchError",
    "Capabilities",
    "Communicator",
    "CommunicatorSpec",
    "CudaDeviceNotSetError",
    "DilationPattern",
    "Environment",
    "EveryRankError",
    "HeadRun",
    "Kernel",
    "KernelChoice",
    "KernelContractError",
    "KernelSpec",
    "KeyWindow",
    "LseGradientKernel",
    "Mode",
    "PeerRejectedError",
    "Pending",
    "Plan",
    "PriorityRule",
    "Request",
    "ResolutionError",
    "Resolver",
    "RingDilatedError",
    "RingDilatedWarning",
    "Selection",
    "ShardPlan",
    "Target",
    "TransferStats",
    "accumulation_dtype",
    "backward_by_piece",
    "backward_in_pieces",
    "backward_with_lse_by_piece",
    "bottom_right_pieces",
    "deterministic_algorithms",
    "every_peer_at_once",
    "forward_by_piece",
    "forward_in_pieces",
    "mark_non_finite_problems",
    "mark_non_finite_rows",
    "merge_partials",
    "piece_seed",
    "process_group",
]
