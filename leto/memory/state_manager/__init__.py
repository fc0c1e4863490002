"""The state-manager process: owns retained memory, serves it to trainers, never runs
user code. ``table`` holds allocations and protection groups, ``server`` the socket loop,
``__main__`` the process entry point (``python -m leto.memory.state_manager``)."""
