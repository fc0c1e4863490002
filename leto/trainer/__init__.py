"""What runs inside the user's training process: ``leto.init()`` (``api``) and ``leto.Run``
(``run``) with their helpers — retained state and its update (``retained``), gradient
buckets, the data, loop and RNG state a recovery restores, the checkpoint fallback
(``checkpoint``, ``staging``), the imports and warm-up a parked shadow does ahead
(``imports``, ``warmup``, ``premap``), profiling, and the refusals of ranks sharing a GPU
(``shared_gpu``). A parked shadow is a trainer process too: it waits inside
``leto.init()`` until promoted.

May not: import ``leto.launch`` (a trainer dies with its failures; what survives them lives
in the agent and the state manager), or keep model state the state manager does not hold
(what is not retained is lost with the process).
"""
