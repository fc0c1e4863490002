"""verifiers: fault-free reference runs and bit-exact comparison of training state.

Comparisons are byte-exact (``torch.equal`` on raw bytes) and name the first
iteration, tensor and offset that differ. Nothing is implemented in this package yet:
it arrives with the training loop it verifies.
"""
