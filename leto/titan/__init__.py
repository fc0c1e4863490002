"""torchtitan under Leto. Runs inside each trainer process that ``leto run`` starts; it
imports torchtitan (0.2.x), which the rest of Leto never does.

``leto run --nproc-per-node N -m leto.titan.train <torchtitan's flags>`` is torchtitan's
``torchrun ... -m torchtitan.train <flags>`` with torchtitan's own entry point given
``LetoTrainer`` (how torchtitan's experiments bring their trainers). ``LetoTrainer`` is
torchtitan's ``Trainer``: it builds what torchtitan builds, then retains it —
its model part (FSDP2 shards included), the AdamW of its ``OptimizersContainer``, the
LambdaLRs of its ``LRSchedulersContainer``, its stateful data loader, ``ntokens_seen`` —
and runs torchtitan's ``train_step`` as ``leto run``'s iterations (docs/porting.md,
"torchtitan")."""
