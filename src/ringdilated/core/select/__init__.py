"""Layer 3, selection: specs as data, and who serves a call and why.

What a backend declares (:mod:`.capabilities`, :mod:`.communicator_spec`), the resolver that
picks a kernel and a communicator and explains every rejection (:mod:`.resolver`), the traffic
model it ranks communicators by (:mod:`.cost`), the dtype policy (:mod:`.dtypes`) and what a
request's features cost a choice (:mod:`.feature_cost`). Runs on the host, once per call
signature. Imports only the layers below.
"""

from ringdilated.core.select.capabilities import *  # noqa: F403
from ringdilated.core.select.dtypes import *  # noqa: F403
from ringdilated.core.select.feature_cost import *  # noqa: F403
