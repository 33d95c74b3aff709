"""What every backend agrees on: the pattern, the kernel contract, the accumulator, capabilities,
the resolver and the single-process driver. Imports torch and attrs only, never a backend."""

from ringdilated.core.accumulator import Accumulator, accumulation_dtype, merge_partials
from ringdilated.core.capabilities import (
    Capabilities,
    Environment,
    KernelSpec,
    PriorityRule,
    Request,
    Target,
)
from ringdilated.core.kernel import BlockOptions, Kernel
from ringdilated.core.pattern import MODES, Block, DilationPattern, HeadRun, Mode, Selection
from ringdilated.core.resolver import KERNEL_ENV_VAR, Plan, ResolutionError, Resolver

__all__ = [
    "KERNEL_ENV_VAR",
    "MODES",
    "Accumulator",
    "Block",
    "BlockOptions",
    "Capabilities",
    "DilationPattern",
    "Environment",
    "HeadRun",
    "Kernel",
    "KernelSpec",
    "Mode",
    "Plan",
    "PriorityRule",
    "Request",
    "ResolutionError",
    "Resolver",
    "Selection",
    "Target",
    "accumulation_dtype",
    "merge_partials",
]
