"""nvbit_tools: kernel-level abort instrumentation.

NVBit is not installed on the machines this project runs on and cannot be fetched, so
no NVBit code is built here. What exists instead: ``faultkit`` mode ``kill`` on
``--device cuda`` SIGKILLs a rank with its kernels (optimizer, parity update, parity
copy) in flight, which FACTS.md measured to leave genuinely torn output.

Not built yet: the trip-wire in Leto's own kernels (an abort flag read with a
system-scope load of host-mapped memory, stopping blocks after the N-th). An NVBit
aborter would plug into the same interface: a tool library injected with
``LD_PRELOAD`` that, armed by ``LETO_FAULT_AT``, instruments the named kernel's exit
paths to return early after N blocks and then raises SIGKILL from its host callback —
faultkit would select it as ``--mode kernel-abort``, exactly where the trip-wire goes.
"""
