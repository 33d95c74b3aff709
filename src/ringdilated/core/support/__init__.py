"""Layer 0, support: what every layer may use and that knows nothing of attention.

Environment variables read strictly (:mod:`.env`), where a warning points (:mod:`.caller`),
and the objects ``torch.compile`` passes into a graph untraced (:mod:`.opaque`). Imports
nothing else of ``ringdilated``.
"""
