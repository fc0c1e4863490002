"""The Leto runtime: ``leto run`` (node agent, rank cells, shadow trainers, failure
monitor, job-wide recovery) and the trainer-side API ``leto.init()``.

Process model: one agent per node (``agent.py``, the ``leto run`` process) owns, per
local rank, a cell (``cell.py``): a state manager, the active trainer and a parked
shadow trainer. Agents coordinate only through torch.distributed's TCPStore
(``store.py``), one key namespace per recovery generation. Trainers call
``leto.init()`` (``api.py``); a shadow parks inside it until promoted.
"""
