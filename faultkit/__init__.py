"""faultkit: fault injection for Leto and for plain PyTorch jobs.

Each injector says which mechanism actually ran (a real one, or an honest emulation
where the machine lacks it) so that verdicts never overstate what was tested.
"""
