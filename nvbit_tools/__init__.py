"""nvbit_tools: kernel-level aborts.

``nvbit_tools.tripwire`` is what runs: Leto's own kernels (the erasure codec's
GF(2^16) kernel for parity encode/update and tier 2, the parity copies, the
optimizer's landing of each chunk) honour a trip-wire that lets the first N blocks run
and holds the rest while the process is SIGKILLed, so the output is genuinely partial.
faultkit selects it with ``--mode kernel-abort``. On the CPU backend the same calls
are an emulation (tile by tile), and say so.

NVBit is not installed on the machines this project runs on and cannot be fetched, so
no NVBit code is built here. An NVBit aborter would plug into the same interface: a
tool library injected with ``LD_PRELOAD`` that, when faultkit's hook calls
``tripwire.arm(n)`` (through a shared flag the tool reads), instruments the next
launched kernel's entry so blocks after the n-th spin, and whose host callback then
calls ``tripwire.fire`` — covering torch's own kernels (forward, backward, NCCL) that
the trip-wire cannot reach.
"""
