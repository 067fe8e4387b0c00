"""Holding and moving training state: a layer's weights and optimizer state, wherever it goes.

One layer's state (:mod:`.layer_state`) and the script's own (:mod:`.user_state`), carried across
a change of held layers (:mod:`.carry_over`); the commit protocol that says which step every
holder applied (:mod:`.commit`); where state comes from when a plan is entered
(:mod:`.restore`): live peers (:mod:`.migrate`), in-memory snapshots (:mod:`.snapshots`) or the
DCP checkpoint (:mod:`.checkpoint`, :mod:`.dcp_parts`, :mod:`.background_save`).

Imports go down only: this room uses the runtime's base modules and :mod:`..world`.
"""
