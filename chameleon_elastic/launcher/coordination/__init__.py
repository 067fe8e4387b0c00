"""How the agents agree on the next plan, and the rounds in which they meet.

A round (:mod:`.rounds`: a quick round on the last one's store, or torch's rendezvous, and the
worker store each round opens) carries one agreement (:mod:`.agreement`: report, decide and
publish, adopt, fenced by a record that outlives rounds). What crosses the store is in
:mod:`.messages`; the decision itself is a pure function of the reports (:mod:`.decide`).
:mod:`.waiting` says what a node waits for at the first rendezvous, :mod:`.exit_barrier` ends
a run without waiting for a node that is gone.

Imports go down only: this room uses the launcher's base modules (observe, plan_env, session).
"""
