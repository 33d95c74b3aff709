"""Stand-ins for the optional GPU packages and torch's CUDA attention ops, run on CPU.

They enforce what upstream enforces and read memory the way upstream's kernels do, so the
``flash``, ``xformers``, ``flex`` and ``sdpa`` (CUDA path) wrappers are wrong here exactly where
they would be wrong on a GPU:

- :mod:`.flash_attn`: each supported flash-attn version's exact Python signatures and return
  tuples, ``flash_api.cpp``'s checks, ``softmax_lse`` read as dense float32 by address;
- :mod:`.mem_efficient`: torch's memory-efficient kernels and ops (the sdpa CUDA path, and the
  ``aten._efficient_attention_*`` ops xformers' ``cutlass`` operators call), keys and values
  read through their strides, ``out`` read with the backward's hard-coded row stride, the lse
  read in 32-row blocks, the bias over-read, the dropout mask drawn from the generator's Philox
  state and replayed from the scalars given;
- :mod:`.torch_flash`: torch's flash ops (``torch_flash``): bottom-right ``is_causal`` and key
  window, the lse read by address, dropout replayed from ``rng_state``;
- :mod:`.flash_windows`: how each flash op rewrites ``causal`` and its window arguments into the
  mask its kernel applies (flash-attn 2 and torch's copy, FlashAttention 3, FlashAttention 4);
- :mod:`.cudnn`: torch's cuDNN op (``cudnn``): top-left ``is_causal``, an expanded additive
  bias, key and value head counts that each divide the query's (``dk``, ``dv`` like ``key``,
  ``value``), the lse read through its own strides, unwritten outputs for empty inputs;
- :mod:`.philox`: the CUDA generator's ``(seed, offset)`` state and the draws made from it;
- :mod:`.xformers`: xformers 0.0.35's ``fmha`` API over the same ops (its input validation,
  operator checks, BMGHK forward and BMHK-only backward), and its refusal of CUDA calls when
  its compiled extension did not load;
- :mod:`.flex`: ``flex_attention``'s signature in differentiable math, a ``BlockMask`` read
  block by block as the Triton kernels read it;
- :mod:`.memory`: reading a tensor's memory with the addressing a kernel assumes.
"""

from tests.standins.cudnn import cudnn_attention, cudnn_attention_backward
from tests.standins.flash_attn import VERSIONS as FLASH_VERSIONS
from tests.standins.flash_attn import install_flash_attn
from tests.standins.flex import math_flex_attention
from tests.standins.mem_efficient import efficient_attention, efficient_attention_backward
from tests.standins.torch_flash import (
    bshd_flash_attention,
    bshd_flash_attention_backward,
    flash_attention,
    flash_attention_backward,
)
from tests.standins.xformers import install_xformers

__all__ = [
    "FLASH_VERSIONS",
    "bshd_flash_attention",
    "bshd_flash_attention_backward",
    "cudnn_attention",
    "cudnn_attention_backward",
    "efficient_attention",
    "efficient_attention_backward",
    "flash_attention",
    "flash_attention_backward",
    "install_flash_attn",
    "install_xformers",
    "math_flex_attention",
]
