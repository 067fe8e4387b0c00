"""The processes a worker talks to, and how it gets out when one of them is lost.

Making the world and a plan's subgroups (:mod:`.groups`), joining a generation's world
(:mod:`.join`, :mod:`.regroup`), talking to this node's agent (:mod:`.link`), sending device
tensors point to point, through host memory where the backend cannot read the device's
(:mod:`.wire`), and cutting a transfer blocked on a peer that is gone (:mod:`.abort`).
:mod:`.local_world` runs a world of real gloo processes on one machine for tests, benchmarks
and examples.

Imports go down only: this room uses the runtime's base modules (errors, topology) and nothing
of the other rooms; state, execution and recovery build on it.
"""
