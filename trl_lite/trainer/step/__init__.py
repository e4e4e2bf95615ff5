"""The data path of one ``step()``, in the order data flows.

``experience`` (the batch handed to ``step()`` and the :class:`Experience` made of it) ->
``experience_maker`` (rollout passes, rewards, advantages) with ``rollout_plan`` (which no-grad passes run) ->
``forward`` (log-probs and values of rows, in passes) -> ``pass_plan`` (the passes of each backward batch) ->
``learner`` (the epochs of mini-batches) with ``objective`` (the policy's loss) and ``ptx`` (the pretraining
loss) -> ``statistics`` (what a step reports); ``transfer`` moves a step's data host <-> device in one copy
each way, ``timing`` clocks the phases.

May import: ``memory/``, ``state/``, ``layout/`` and the packages outside the trainer (``core``, ``models``,
``engines``, ``parallel``); never the faces above it.
"""
