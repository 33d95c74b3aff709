"""The built-in backends. Each module depends on :mod:`ringdilated.core` only and exports its
spec(s); :mod:`ringdilated.plugins.builtins` offers them through the same hooks a third party
implements. Kernels: ``sdpa`` (PyTorch's fused attention ops), ``flash`` (flash-attn 2),
``xformers``, ``flex`` (FlexAttention) and ``reference`` (plain PyTorch math); communicators:
``local``, ``ringpass``, ``allgather``, ``ulysses`` and ``hybrid``, each described by its
``CommunicatorSpec`` alone."""
