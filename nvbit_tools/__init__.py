"""nvbit_tools: kernel-level abort instrumentation.

NVBit is not installed on the machines this project runs on and cannot be fetched, so
the built-in mechanism (to come with the fault-injection issue) is a trip-wire in
Leto's own kernels plus SIGKILL while kernels are in flight. Nothing is implemented in
this package yet.
"""
