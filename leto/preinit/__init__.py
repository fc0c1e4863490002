"""OOM-free preinitialization (paper §6): the controller's policy (``policy``), the
allocation-path reclamation hook (``reclaim``) and the memory timeline (``timeline``).
See docs/preinit.md."""
