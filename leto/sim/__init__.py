"""ETTR model and failure simulator (paper Appendix C): ``model`` (Eq. 6-8),
``iteration`` (C.1), ``events`` (discrete-event replay of ``leto.sim.schedule``
schedules), ``profiles`` (inputs with sources), ``scenarios``, ``plots`` and ``cli``.
Pure Python; runs in whatever process imports it. See docs/sim.md."""
