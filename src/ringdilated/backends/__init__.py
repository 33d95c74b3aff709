"""The built-in backends, each module exporting its spec(s); :mod:`ringdilated.plugins.builtins`
offers them through the same hooks a third party implements. Kernels: ``sdpa`` (PyTorch's fused
attention ops), ``flash`` (flash-attn 2), ``xformers``, ``flex`` (FlexAttention) and
``reference`` (plain PyTorch math); communicators: ``local`` (one process), ``ringpass`` (point
to point), ``allgather`` (one ``all_gather``), ``ulysses`` (head parallelism by all-to-all) and
``hybrid`` (``ulysses`` within a 2-D layout's inner groups, ``ringpass`` across its outer ones).
``_dense``, ``_heads`` and ``_memeff`` are helpers the kernels share.

A backend depends on :mod:`ringdilated.core` only, as a plugin would: on its exports and its
contract and support layers, never on the engine's planning, selection, running or call layers,
nor on the plugins or the face; besides that, only on modules here (``tests/test_layers.py``)."""
