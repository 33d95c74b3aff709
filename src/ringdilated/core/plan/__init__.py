"""Layer 1, host planning: pure arithmetic on lengths, no tensor data and no peers.

Which positions each head group selects (:mod:`.pattern`), the batch's documents and padding
(:mod:`.documents`), which pieces each rank holds and needs (:mod:`.shards`), and how heads are
dealt to ranks (:mod:`.heads`). Imports only :mod:`ringdilated.core.support`.
"""

from ringdilated.core.plan.documents import *  # noqa: F403
from ringdilated.core.plan.pattern import *  # noqa: F403
