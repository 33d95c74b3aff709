"""ringdilated: exact dilated attention (LongNet) on pluggable kernels.

::

    import ringdilated
    out = ringdilated.dilated_attention(q, k, v, [2048, 4096], [1, 2])  # q: (B, L, H, D)
    attn = ringdilated.DilatedAttention([2048, 4096], [1, 2], causal=True)
    out = attn(q, k, v)
    print(attn.plan.explain())  # the kernel that served the call, and why
    mha = ringdilated.MultiheadDilatedAttention(
        512, 8, segment_lengths=[2048, 4096], dilation_rates=[1, 2]
    )
    out, _ = mha(x, x, x)  # x: (B, L, 512)
    layout = ringdilated.SequenceLayout(cu_seqlens=cu)  # once per batch, for every layer
    out, _ = mha(x, x, x, layout=layout)
    shard = ringdilated.shard_batch(input_ids, process_group=group)  # this rank's part
    logits = model(shard.input_ids, shard.position_ids, layout=shard.layout)
    loss = ringdilated.sharded_cross_entropy(logits, shard.labels, group)  # the batch's mean
"""

from importlib.metadata import PackageNotFoundError, version

from ringdilated.batch import BatchShard, shard_batch
from ringdilated.cache import DilatedKVCache
from ringdilated.core import (
    AgreementError,
    CallMismatchError,
    CudaDeviceNotSetError,
    DilationPattern,
    Environment,
    KernelChoice,
    KernelContractError,
    KernelSpec,
    PeerRejectedError,
    Plan,
    Request,
    ResolutionError,
    Resolver,
    RingDilatedError,
    RingDilatedWarning,
    TransferStats,
)
from ringdilated.core.call import SequenceLayout
from ringdilated.core.select import recommended_dtype
from ringdilated.core.support import (
    DistributedNotInitializedWarning,
    PaddingMaskWarning,
    SlowDtypeWarning,
    SlowFeatureWarning,
)
from ringdilated.functional import dilated_attention
from ringdilated.loss import sharded_cross_entropy, token_weighted_mean
from ringdilated.modules import DilatedAttention
from ringdilated.multihead import MultiheadDilatedAttention
from ringdilated.registry import default_resolver
from ringdilated.transformer import DilatedTransformerBlock

try:
    __version__ = version("ringdilated")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.0.0"

__all__ = [
    "AgreementError",
    "BatchShard",
    "CallMismatchError",
    "CudaDeviceNotSetError",
    "DilatedAttention",
    "DilatedKVCache",
    "DilatedTransformerBlock",
    "DilationPattern",
    "DistributedNotInitializedWarning",
    "Environment",
    "KernelChoice",
    "KernelContractError",
    "KernelSpec",
    "MultiheadDilatedAttention",
    "PaddingMaskWarning",
    "PeerRejectedError",
    "Plan",
    "Request",
    "ResolutionError",
    "Resolver",
    "RingDilatedError",
    "RingDilatedWarning",
    "SequenceLayout",
    "SlowDtypeWarning",
    "SlowFeatureWarning",
    "TransferStats",
    "__version__",
    "default_resolver",
    "dilated_attention",
    "recommended_dtype",
    "shard_batch",
    "sharded_cross_entropy",
    "token_weighted_mean",
]
