"""Layer 0, support: what every layer may use, computing nothing of attention.

The package's exceptions and warnings (:mod:`.errors`), environment variables read strictly
(:mod:`.env`), where a warning points (:mod:`.caller`), and the objects ``torch.compile``
passes into a graph untraced (:mod:`.opaque`). Imports nothing else of ``ringdilated``.
"""

from ringdilated.core.support import opaque as opaque
from ringdilated.core.support.caller import *  # noqa: F403
from ringdilated.core.support.env import *  # noqa: F403
from ringdilated.core.support.errors import *  # noqa: F403
