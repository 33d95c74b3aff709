"""Layer 2, the extension contracts: what a backend implements, and the guard around it.

A kernel (:mod:`.kernel`: ``Kernel``, ``BlockOptions``) and a communicator
(:mod:`.communicator`), the exact merge of partial results (:mod:`.accumulator`), the
bottom-right pieces for kernel authors (:mod:`.causal`), the lse's gradient through a block
(:mod:`.lse`: the kernel's own, or a second backward call), the checks on every kernel result
(:mod:`.guard`) and the field rules specs are validated by (:mod:`.rules`). Backends depend on
this layer and on :mod:`ringdilated.core.select`'s specs, re-exported by
:mod:`ringdilated.core`. Imports only the layers below.
"""
