"""Layer 0, support: what every layer may use, computing nothing of attention.

The package's exceptions and warnings (:mod:`.errors`), environment variables read strictly
(:mod:`.env`), where a warning points (:mod:`.caller`), and the objects ``torch.compile``
passes into a graph untraced (:mod:`.opaque`). Imports nothing else of ``ringdilated``.
"""

from ringdilated.core.support import opaque as opaque
from ringdilated.core.support.caller import user_stacklevel as user_stacklevel
from ringdilated.core.support.env import unknown_names as unknown_names
from ringdilated.core.support.errors import (
    DistributedNotInitializedWarning as DistributedNotInitializedWarning,
)
from ringdilated.core.support.errors import PaddingMaskWarning as PaddingMaskWarning
from ringdilated.core.support.errors import SlowDtypeWarning as SlowDtypeWarning
