"""What the agent watches, and how it tells a lost device from a slow or crashed program.

Its workers' exits, classified (:mod:`..failures` holds the vocabulary), hangs and peers lost
elsewhere (:mod:`.detectors`), the device health hook (:mod:`.health`), the etcd leases of the
other nodes (:mod:`.node_watch`), the speed of each local device (:mod:`.stragglers`) and the
generations abandoned before they committed a step (:mod:`.generations`).

Imports go down only: this room uses the launcher's base modules (failures, observe, plan_env,
reactions) and nothing of the other rooms.
"""
