"""What people and machines read of a run, beyond the event log and the status line.

One line and one ``recovered`` event per recovery (:mod:`.reporter`), Prometheus metrics and
probes (:mod:`.metrics`), the measured profile of a script (:mod:`.profiler`), and the run's
state directory (:mod:`.state_dir`). The event log and the status line themselves are in
:mod:`..observe`, which every room writes to.

Imports go down only: this room reads the decisions of :mod:`..coordination` to report them.
"""
