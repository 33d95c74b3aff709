"""Layer 5, the call: one dilated-attention call from its arguments to its plan.

Process layouts (:mod:`.grid`), argument checks (:mod:`.validation`), the ranks' agreement
(:mod:`.agreement`), the batch's :class:`~.sequence_layout.SequenceLayout`, and
:func:`~.prepare.prepare_call`, which makes the call's plan. Imports only the layers below.
The face (``functional``, the modules, the Hugging Face adapter) sits on top, importing from
``ringdilated.core`` and from each layer what its ``__init__`` exports (``X as X``).
"""

from ringdilated.core.call import grid as grid
from ringdilated.core.call.agreement import agree as agree
from ringdilated.core.call.agreement import shard_lengths as shard_lengths
from ringdilated.core.call.grid import Grid as Grid
from ringdilated.core.call.grid import warn_if_launched_alone as warn_if_launched_alone
from ringdilated.core.call.prepare import WHOLE_SEQUENCES as WHOLE_SEQUENCES
from ringdilated.core.call.prepare import CallOptions as CallOptions
from ringdilated.core.call.prepare import CallPlan as CallPlan
from ringdilated.core.call.prepare import PatternArgs as PatternArgs
from ringdilated.core.call.prepare import as_process_group as as_process_group
from ringdilated.core.call.prepare import call_state as call_state
from ringdilated.core.call.prepare import group_size as group_size
from ringdilated.core.call.prepare import operands as operands
from ringdilated.core.call.prepare import plan_for as plan_for
from ringdilated.core.call.prepare import prepare_call as prepare_call
from ringdilated.core.call.sequence_layout import SequenceLayout as SequenceLayout
from ringdilated.core.call.validation import check_bool as check_bool
from ringdilated.core.call.validation import check_options as check_options
