"""OOM-free preinitialization (paper §6): the controller's policy (``policy``), the
allocation-path reclamation hook (``reclaim``), the memory timeline (``timeline``), and
their wiring into ``leto run --shadow-level auto``: the agent's per-rank controllers
(``levels``) and the active trainer's guard (``guard``). See docs/preinit.md."""
