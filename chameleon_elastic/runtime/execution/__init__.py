"""Executing a training step under a plan: the 1F1B order, the transfers, the gradient sums.

One step (:mod:`.step`): this device's operation order (:mod:`.executor`) on micro-batches read
ahead (:mod:`.feed`), messages matched as the back-end delivers them (:mod:`.inbox`), random
streams that do not depend on the plan (:mod:`.streams`), gradients summed by colour rounds
(:mod:`.grad_sync`, with the plan's :mod:`.layout`), progress through the phases of a step
(:mod:`.phases`), and forward-only evaluation (:mod:`.evaluation`).

Imports go down only: this room uses the runtime's base modules, :mod:`..world` and
:mod:`..state`.
"""
