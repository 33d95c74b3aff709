"""The built-in backends. Each module is a plugin, registered through the same hooks as a
third party's: ``sdpa`` (PyTorch's fused attention ops) and ``reference`` (plain PyTorch math)."""
