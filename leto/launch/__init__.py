"""What ``leto run`` runs: the node agent and what it drives, in the agent's process (and
the zygote it forks trainers from).

One agent per node (``agent``, the ``leto run`` process) owns, per local rank, a cell
(``cell``): a state manager, the active trainer and a parked shadow trainer
(``shadows``). It watches them (``monitor``), runs the job-wide recovery (``recovery``),
relays the trainers' console lines (``relay``) and forks trainers and shadows from a
zygote that imported torch once (``zygote``). Agents coordinate only through
torch.distributed's TCPStore (``leto.job.store``), one key namespace per recovery
generation.

May not: import ``leto.trainer`` (the agent never runs a training step, and must outlive
every trainer it starts), create a CUDA context in the agent (it holds no device state;
the state managers own the pools — it asks the driver for a GPU's size only), or block
without a timeout (a hung agent is a hung job).
"""
