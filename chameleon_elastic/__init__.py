"""chameleon-elastic: a torchrun-compatible launcher with failure-aware elasticity.

Importing the package is cheap and never imports torch: the planner, the spec and the plan are
pure Python, so ``chameleon-plan`` and ``chameleon-sim`` start fast and scale to 2048 devices.
"""

__version__ = "0.1.0"
