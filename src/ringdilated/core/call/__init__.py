"""Layer 5, the call: one dilated-attention call from its arguments to its plan, and its run.

Process layouts (:mod:`.grid`), argument checks (:mod:`.validation`), NCCL's current device
(:mod:`.nccl_device`), the ranks' agreement (:mod:`.agreement`), the batch's
:class:`~.sequence_layout.SequenceLayout`, :func:`~.prepare.prepare_call`, which makes the call's
plan, and :func:`~.prepare.execute`, which runs it. The face (``functional``, the compiled ops,
the modules, the Hugging Face adapter) sits on top, importing what each layer's ``__init__``
re-exports (modules' ``__all__``). Imports only the layers below.
"""

from ringdilated.core.call import grid as grid
from ringdilated.core.call.agreement import *  # noqa: F403
from ringdilated.core.call.grid import *  # noqa: F403
from ringdilated.core.call.nccl_device import *  # noqa: F403
from ringdilated.core.call.prepare import *  # noqa: F403
from ringdilated.core.call.sequence_layout import *  # noqa: F403
from ringdilated.core.call.validation import *  # noqa: F403
