"""The silent-corruption checks, as docs/integrity.md presents them, with the process each
runs in:

* ``scrub`` — device pages against their parity, a slice an iteration (trainer);
* ``replica`` — replicas' update digests compared (trainer);
* ``recheck`` and ``settle`` — a sampled chunk's update computed again, a disagreement
  settled by a third computation (trainer, inside the updater's chunk transaction);
* ``replay`` — a gradient computed again and compared (trainer);
* ``loss_guard`` — non-finite losses agreed on by every rank (trainer);
* ``faulty`` — the record of devices named faulty, kept across recoveries (agent).

The locating decoder the scrub uses is the codec's (``leto.erasure.locate``). The updater
calls the checks through their narrow interfaces (``Recheck``, ``group_digest``,
``settle.chunk``). May not: import ``leto.launch`` or ``leto.trainer`` (both sides import
the checks' settings).
"""
