"""Layer 0, support: what every layer may use, computing nothing of attention.

The package's exceptions and warnings (:mod:`.errors`), environment variables read strictly
(:mod:`.env`), where a warning points (:mod:`.caller`), and the objects ``torch.compile``
passes into a graph untraced (:mod:`.opaque`). Imports nothing else of ``ringdilated``.
"""
