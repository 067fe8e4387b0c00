"""The agent's worker processes: how they start, what they are told, where they write, how they stop.

The processes by device, across launches (:mod:`.processes`), started one device at a time with
the generation made known first (:mod:`.starter`), each with torchrun's environment and the
plan's (:mod:`.worker_env`), their stderr (:mod:`.worker_logs`), dying with their agent
(:mod:`.orphan_guard`), and stopping at a step boundary on a preemption signal
(:mod:`.preemption`).

Imports go down only: this room uses the launcher's base modules (observe, plan_env).
"""
