"""What keeps a pass's memory bounded.

``token_budget`` (rows split into passes by a token budget), ``oom_backoff`` (a pass that runs out of memory
is redone in smaller passes), ``prefix_sharing`` (a group's shared prompt run once per pass), ``cpu_memory``
(freed memory kept inside the process between mini-batches).

May import: ``layout/`` and the packages outside the trainer; never ``step/`` or the faces.
"""
