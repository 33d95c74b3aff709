"""Layer 5, the call: one dilated-attention call from its arguments to its plan.

Process layouts (:mod:`.grid`), argument checks (:mod:`.validation`), the ranks' agreement
(:mod:`.agreement`), the batch's :class:`~.sequence_layout.SequenceLayout`, and
:func:`~.prepare.prepare_call`, which makes the call's plan. The face (``functional``, the
modules, the Hugging Face adapter) sits on top. Imports only the layers below.
"""
