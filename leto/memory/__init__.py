"""Resilient Memory Pool: retained memory owned by a state-manager process (paper §4).

Process model (the folder tree mirrors it): ``state_manager/`` runs in the state-manager
process and never runs user code; ``client`` runs in trainers; ``backends/`` has the
page backends used by both sides; ``protocol`` defines every message between them.
"""
