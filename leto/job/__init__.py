"""What the launcher and the trainers share: the job's configuration and its environment
variables (``config``), the fault plan faultkit injects (``fault_plan``), the TCPStore's
keys (``keys``) and its connection (``store``).

Runs in both the agent and the trainers (and faultkit). May not: import ``leto.launch`` or
``leto.trainer`` (both sides import it), or torch.cuda (the agent imports it).
"""
