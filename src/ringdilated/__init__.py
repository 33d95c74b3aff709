"""ringdilated: exact dilated attention (LongNet) on pluggable kernels.

import ringdilated
out = ringdilated.dilated_attention(q, k, v, [2048, 4096], [1, 2])
attn = ringdilated.DilatedAttention([2048, 4096], [1, 2], causal=True)
print(attn.plan.explain())
"""

from importlib.metadata import PackageNotFoundError, version

from ringdilated.core import (
    DilationPattern,
    Environment,
    KernelSpec,
    Plan,
    Request,
    ResolutionError,
    Resolver,
)
from ringdilated.core.dtypes import SlowDtypeWarning, recommended_dtype
from ringdilated.functional import default_resolver, dilated_attention
from ringdilated.modules import DilatedAttention

try:
    __version__ = version("ringdilated")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.0.0"

__all__ = [
    "DilatedAttention",
    "DilationPattern",
    "Environment",
    "KernelSpec",
    "Plan",
    "Request",
    "ResolutionError",
    "Resolver",
    "SlowDtypeWarning",
    "__version__",
    "default_resolver",
    "dilated_attention",
    "recommended_dtype",
]
