"""Recovering in place: only the training loop restarts, in the surviving processes.

Entering a plan, the one chain for a start, a resume, a joiner and a survivor
(:mod:`.entering`); the worker's side of a recovery (:mod:`.in_place`) and the deadlines that
bound each of its phases (:mod:`.deadlines`); a standby that waits warm for a place
(:mod:`.standby`); and stopping for a preemption at a step boundary (:mod:`.preemption`).

Imports go down only: this room uses every other room of the runtime; only the trainer uses it.
"""
