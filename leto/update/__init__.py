"""Resumable Model Updater (paper §5): chunk-level transactions over retained state.

``marker`` (the progress record), ``schedule`` (learning rate), ``layout`` (how model
state maps onto pool allocations, units and chunks), ``optim`` (element-wise AdamW on
a chunk, bit-identical to ``torch.optim.AdamW(foreach=False)``), ``rmu`` (the updater:
gradient parity, chunked transactional update, resumption and recovery).
Runs in the trainer.
"""
