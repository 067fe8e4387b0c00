"""Plan agreement between agents (launcher/coordination/agreement.py), in-process on torch's HashStore:
report, decide and publish, adopt, with no process launched."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch.distributed as dist

from chameleon_elastic.exit_status import ExitStatus
from chameleon_elastic.launcher.coordination import agreement as protocol
from chameleon_elastic.launcher.coordination import decide as deciding
from chameleon_elastic.launcher.coordination import messages
from chameleon_elastic.launcher.coordination.messages import Agreement, Decision, NodeReport
from chameleon_elastic.launcher.session import JobSession, LauncherPlanningError
from chameleon_elastic.plan import ExecutionPlan, Pipeline
from chameleon_elastic.spec import JobSpec


@pytest.fixture
def session(tmp_path):
    return JobSession(JobSpec.preset("tiny-cpu"), "auto", tmp_path / "plans", warm_cache=False)


def _published(session, reports, lost, joined=(), renew=True):
    """What a decider publishes after taking the step from the reports (``agree``'s part)."""
    base = session.digest
    session.step(lost, joined, {}, renew)
    decision = deciding.decide(session.plan, session.excluded, reports, inplace_wanted=True,
                                   why=deciding.reasons(reports, lost, 2))
    return decision, Agreement.of(decision, base=base, digest=session.digest,
                                  lost=tuple(sorted(lost)), joined=tuple(sorted(joined)),
                                  renew=renew)


def test_two_agents_agree_on_one_plan_through_a_store(session, tmp_path):
    store = dist.HashStore()
    # node 1 (devices 2, 3) lost device 3; node 0 is intact; every live worker is registered
    protocol.report(store, "r1/", 1, NodeReport(1, (3,), (2,), True, reported=7,
                                                    checkpoint=None))
    protocol.report(store, "r1/", 0, NodeReport(0, (), (0, 1), True, reported=None))
    reports = protocol.collect(store, "r1/", range(2))
    lost, joined = deciding.losses(reports, session.excluded, session.devices, 2)
    assert (lost, joined) == ({3}, set())
    decision, agreement = _published(session, reports, lost, joined)
    protocol.publish(store, "r1/", agreement)

    other = JobSession(JobSpec.preset("tiny-cpu"), "auto", tmp_path / "other", warm_cache=False)
    adopted, change = protocol.adopt(protocol.read_agreement(store, "r1/", timeout_s=5),
                                         other, desk=None)   # replayed: nothing to fetch
    assert adopted == decision
    assert change is not None and change.lost == (3,) and change.agreed == "replayed"
    assert other.plan == session.plan and other.excluded == {3}
    assert other.digest == session.digest
    assert decision.inplace and decision.reported == 7 and decision.error is None
    assert decision.world == tuple(session.plan.working_devices)


def test_a_node_that_did_not_report_loses_its_devices_and_comes_back(session):
    reports = [NodeReport(0, (), (0, 1), True)]
    lost, joined = deciding.losses(reports, set(), 4, 2)
    assert lost == {2, 3} and joined == set()
    back = [NodeReport(0, (), (0, 1), True), NodeReport(1, (), (), True)]
    assert deciding.losses(back, {2, 3}, 4, 2) == (set(), {2, 3})


def test_unregistered_workers_or_relaunch_wanted_mean_relaunch(session):
    session.apply(lost={1})
    plan = session.plan
    ready = [NodeReport(0, (1,), (0, 2, 3), True)]
    assert deciding.decide(plan, {1}, ready, True).inplace
    assert not deciding.decide(plan, {1}, ready, False).inplace   # relaunch wanted
    script = [NodeReport(0, (1,), (0, 2, 3), False)]
    assert not deciding.decide(plan, {1}, script, True).inplace   # not the runtime


def test_every_relaunch_counts_and_every_agent_reads_the_same_count(session):
    """TORCHELASTIC_RESTART_COUNT comes from the decision, so that every rank of a world
    scopes torch's env:// store keys alike: 0 at the first launch, one more per relaunch,
    none for an in-place regroup; the agreement carries it to the agents that replay."""
    plan = session.plan
    ready, script = [NodeReport(0, (), (0, 1, 2, 3), True)], [NodeReport(0, (), (0,), False)]
    assert deciding.decide(plan, (), script, True).launches == 0   # no record: the first
    assert deciding.decide(plan, (), script, True, launched=0).launches == 1
    assert deciding.decide(plan, (), script, True, launched=4).launches == 5
    assert deciding.decide(plan, (), ready, True, launched=4).launches == 4   # in place
    relaunch = deciding.decide(plan, (), script, True, launched=2)
    assert messages.Agreement.decode(messages.Agreement.of(relaunch).encode()).decision.launches \
        == 3
    assert messages.Decision.decode(relaunch.encode()).launches == 3   # the record keeps it


def test_nothing_changed_but_a_regroup_is_a_new_generation_of_the_same_layout(session):
    before = session.plan
    assert session.apply(lost=(), joined=()) is None
    change = session.renew()
    assert change.plan.generation == before.generation + 1
    assert change.plan.pipelines == before.pipelines and change.plan.transfers == ()
    assert session.plan_file.endswith(f"plan-gen{before.generation + 1}.json")


def test_a_loss_after_regroups_of_the_same_layout_is_planned_from_the_newest_generation(session):
    """The plan cache follows the renewed plan: a loss after two regroups of the same layout
    (a worker's lost peer, a straggler's kept plan) gets the next generation, not one that the
    workers already left (they would sleep in it until each is declared hung: trial under load,
    every device lost)."""
    session.renew()
    session.renew()
    renewed = session.plan.generation
    change = session.apply(lost={3})
    assert change is not None and change.cached
    assert change.plan.generation == renewed + 1


def test_spares_with_a_live_worker_stay_in_an_inplace_world():
    plan = ExecutionPlan("replan", 1, (Pipeline((0, 1), ((0, 4), (4, 8)), 4),
                                       Pipeline((2,), ((0, 8),), 4)),
                         spare_devices=(3,)).validate()
    assert messages.world_of(plan, {0, 1, 2, 3}, inplace=True) == (0, 1, 2, 3)
    assert messages.world_of(plan, {0, 1, 2, 3}, inplace=False) == (0, 1, 2)
    assert messages.world_of(plan, {0, 1, 2}, inplace=True) == (0, 1, 2)


def test_lost_layers_without_a_checkpoint_end_the_job_in_one_sentence(tmp_path):
    session = JobSession(JobSpec.preset("tiny-cpu").with_snapshot_every(0), "auto",
                         tmp_path / "plans", warm_cache=False)   # no in-memory snapshots
    session.apply(lost={1, 3})   # both replicas of layers 4-7
    plan = session.plan
    assert plan.checkpoint_layers == (4, 5, 6, 7)
    no_ckpt = [NodeReport(0, (1, 3), (0, 2), True, checkpoint=None)]
    decision = deciding.decide(plan, {1, 3}, no_ckpt, True)
    assert decision.error is not None and "layers 4-7" in decision.error
    assert "checkpoint" in decision.error and "\n" not in decision.error
    with_ckpt = [NodeReport(0, (1, 3), (0, 2), True, checkpoint=10)]
    assert deciding.decide(plan, {1, 3}, with_ckpt, True).error is None
    relaunch = deciding.decide(plan, {1, 3}, no_ckpt, False)
    assert relaunch.error is None and not relaunch.inplace   # a relaunch says so itself
    # the job checkpoints but lost them before its first one: start over, relaunched
    before_first = [NodeReport(0, (1, 3), (0, 2), True, checkpoint=None, checkpoints=True)]
    over = deciding.decide(plan, {1, 3}, before_first, True)
    assert over.error is None and not over.inplace


def test_lost_layers_a_live_partner_keeps_a_snapshot_of_go_on_in_place(session):
    session.apply(lost={1, 3})   # both replicas of layers 4-7; 1's snapshot is on device 2
    plan = session.plan
    assert plan.checkpoint_layers == () and plan.snapshot_layers == (4, 5, 6, 7)
    no_ckpt = [NodeReport(0, (1, 3), (0, 2), True, checkpoint=None)]
    decision = deciding.decide(plan, {1, 3}, no_ckpt, True)
    assert decision.error is None and decision.inplace


def test_a_working_device_without_a_live_worker_starts_one_and_every_agent_knows():
    """A crashed worker restarted in place: the survivors' regroup waits for a process start,
    on every node (runtime/recovery/deadlines.py), so the decision says which devices start."""
    plan = ExecutionPlan("replan", 1, (Pipeline((0, 1), ((0, 4), (4, 8)), 4),
                                       Pipeline((2, 3), ((0, 4), (4, 8)), 4))).validate()
    crashed = [NodeReport(0, (), (0, 1), True), NodeReport(1, (), (3,), True)]
    decision = deciding.decide(plan, set(), crashed, True)
    assert decision.starting == (2,)
    agreement = messages.Agreement.of(decision)
    assert messages.Agreement.decode(agreement.encode()).resolve(plan).starting == (2,)
    assert deciding.decide(plan, set(), crashed, False).starting == ()   # all start anyway


def test_decisions_round_trip_as_json(session):
    session.apply(lost={2})
    d = Decision(session.plan, (2,), (0, 1, 3), True, 4, None, starting=(3,))
    assert Decision.from_json(d.to_json()) == d
    failed = Decision(None, (), (), False, None, "no plan")
    assert Decision.from_json(failed.to_json()) == failed


def test_the_plan_record_fences_a_decision_made_from_a_stale_view(session, tmp_path):
    fence = dist.HashStore()
    seen, newest = protocol.read_record(fence)
    assert (seen, newest) == ("", None)
    session.apply(lost={1})
    first = deciding.decide(session.plan, session.excluded,
                                [NodeReport(0, (1,), (0, 2, 3), True)], True)
    protocol.commit_record(fence, seen, first)
    seen, newest = protocol.read_record(fence)
    assert newest == first
    # an agent cut off since the start still holds generation 0 and the empty record it read
    stale = JobSession(JobSpec.preset("tiny-cpu"), "auto", tmp_path / "stale", warm_cache=False)
    stale.apply(lost={2})
    late = deciding.decide(stale.plan, stale.excluded, [NodeReport(0, (2,), (0, 1, 3), True)],
                               True)
    with pytest.raises(messages.Fenced, match="published meanwhile"):
        protocol.commit_record(fence, "", late)
    assert protocol.read_record(fence)[1] == first   # the newer plan stands
    session.apply(lost={3})
    second = deciding.decide(session.plan, session.excluded,
                                 [NodeReport(0, (1, 3), (0, 2), True)], True)
    protocol.commit_record(fence, seen, second)      # from the newest view: accepted
    assert protocol.read_record(fence)[1].plan.generation == second.plan.generation


def test_every_agent_learns_how_each_device_was_lost_from_the_node_that_saw_it(session):
    """A worker killed on a live node is named by its signal on every node; only devices whose
    node sent no report at all are "node gone" (it used to be said of any remote device)."""
    store = dist.HashStore()
    protocol.report(store, "r1/", 0, NodeReport(0, (1,), (0,), True, why=((1, "SIGKILL"),)))
    reports = protocol.collect(store, "r1/", range(1))    # node 1 (devices 2, 3) is gone
    lost, _ = deciding.losses(reports, session.excluded, session.devices, 2)
    why = deciding.reasons(reports, lost, 2)
    assert why == ((1, "SIGKILL"), (2, "node gone"), (3, "node gone"))
    decision, agreement = _published(session, reports, lost)
    assert decision.why == why
    protocol.publish(store, "r1/", agreement)
    assert protocol.read_agreement(store, "r1/", timeout_s=5).decision.why == why


def test_a_quick_round_decides_without_a_node_whose_lease_is_gone(session, tmp_path):
    """Quick round on one store, two agents as threads: node 1 dies before reporting; the
    decider (node 0) drops it once its lease is gone, and the decision names who took part.
    A node that reports too late to be counted does not go on with a plan made without it: it
    falls back to a full round (the agent's), as a node whose lease lapsed."""
    import threading

    store = dist.HashStore()
    alive = {0, 1}
    members = messages.Members(0, (0, 1), alive=lambda: set(alive))
    mine = NodeReport(0, (), (0, 1), True)
    result: dict = {}

    def decider() -> None:
        result["decision"], _, _ = protocol.agree(store, "q1/", members, mine, session,
                                                      True, 2, timeout_s=30, quick=True)

    thread = threading.Thread(target=decider)
    thread.start()
    assert not store.check(["q1/decision"])     # still waiting for node 1's report
    alive.discard(1)                             # node 1's lease expires
    thread.join(30)
    assert not thread.is_alive(), "the decider kept waiting for a node whose lease is gone"
    decision = result["decision"]
    assert decision.nodes == (0,) and set(decision.excluded) == {2, 3}

    late = JobSession(JobSpec.preset("tiny-cpu"), "auto", tmp_path / "late", warm_cache=False)
    with pytest.raises(messages.QuickRoundFailed):
        protocol.agree(store, "q1/", messages.Members(1, (0, 1)),
                           NodeReport(1, (), (2, 3), True), late, True, 2, timeout_s=5,
                           quick=True)


def test_the_next_live_member_decides_when_the_decider_is_gone(session, tmp_path):
    """The deciding node is lost before it decides (its lease is gone): giving up for a full
    rendezvous round cost 6.6 s on two nodes. The lowest member still holding its lease
    decides instead, the others adopt its decision, and it says that it decided (it hosts the
    generation's worker store)."""
    import threading

    store = dist.HashStore()
    alive = {0, 1, 2}
    follower = JobSession(JobSpec.preset("tiny-cpu"), "auto", tmp_path / "f", warm_cache=False)
    result: dict = {}

    def follow() -> None:   # node 2: waits for node 0, then for node 1
        result["follower"] = protocol.agree(
            store, "q1/", messages.Members(2, (0, 1, 2), alive=lambda: set(alive)),
            NodeReport(2, (), (4, 5), True), follower, True, 2, timeout_s=30, quick=True)

    thread = threading.Thread(target=follow)
    thread.start()
    alive.discard(0)   # node 0 dies before it reports
    decision, change, decided = protocol.agree(
        store, "q1/", messages.Members(1, (0, 1, 2), alive=lambda: set(alive)),
        NodeReport(1, (), (2, 3), True), session, True, 2, timeout_s=30, quick=True)
    thread.join(30)
    assert not thread.is_alive(), "node 2 never adopted node 1's decision"
    assert decided and change is not None
    assert decision.nodes == (1, 2) and set(decision.excluded) == {0, 1}
    assert dict(decision.why) == {0: "node gone", 1: "node gone"}
    adopted, _, follower_decided = result["follower"]
    assert adopted == decision and not follower_decided
    assert follower.plan == session.plan
    assert protocol.read_record(store)[1] == decision   # fenced: it is the newest


def test_a_replacing_decider_decides_from_what_the_lost_one_committed(session, tmp_path):
    """The decider committed its plan to the record and died before publishing it: the
    replacement reads the record when it takes over, so its plan is the next generation of the
    lost decider's, never a rival of the same generation (which the record's compare-and-set
    would refuse)."""
    store = dist.HashStore()
    lost_decider = JobSession(JobSpec.preset("tiny-cpu"), "auto", tmp_path / "d",
                              warm_cache=False)
    lost_decider.apply(lost={1})
    committed = deciding.decide(lost_decider.plan, lost_decider.excluded,
                                    [NodeReport(0, (1,), (0,), True),
                                     NodeReport(1, (), (2, 3), True)], True)
    protocol.commit_record(store, "", committed)
    decision, _, decided = protocol.agree(
        store, "q1/", messages.Members(1, (0, 1), alive=lambda: {1}),
        NodeReport(1, (), (2, 3), True), session, True, 2, timeout_s=30, quick=True)
    assert decided
    assert decision.plan.generation == committed.plan.generation + 1
    assert set(decision.excluded) == {0, 1}


def test_a_decision_is_published_once_so_a_frozen_decider_cannot_overwrite_its_replacement(
        session):
    store = dist.HashStore()
    _, replacement = _published(session, [NodeReport(1, (), (2, 3), True)], {0, 1})
    protocol.publish(store, "q1/", replacement)
    stale = Agreement(Decision(None, (), (), False, None, "made before the freeze"))
    with pytest.raises(messages.QuickRoundFailed, match="first"):
        protocol.publish(store, "q1/", stale)
    assert protocol.read_agreement(store, "q1/", timeout_s=5) == replacement


class _Reads:
    """A store that notes which thread read which key (and serves the round's keys from one
    HashStore, the record from another: the round's store and the store under it)."""

    def __init__(self, inner, underlying=None):
        self._inner, self.reads = inner, []
        if underlying is not None:
            self.underlying_store = underlying

    def __getattr__(self, name):
        method = getattr(self._inner, name)

        def noted(*args, **kwargs):
            import threading

            if name in ("get", "multi_get", "check"):
                self.reads.append((threading.current_thread().name, name, args[0]))
            return method(*args, **kwargs)

        return noted


def test_state_lost_without_a_checkpoint_ends_every_agent_with_do_not_requeue(tmp_path):
    """Devices 1 and 3 held layers 4-7 and nothing else did (no snapshots, no checkpoint). The
    decider ended the job with exit 1 while the workers, had they seen it first, said 93: a CI
    run got 1. Both agents now end with 93 (a requeue would start over from step 0)."""
    import threading

    spec = JobSpec.preset("tiny-cpu").with_snapshot_every(0)
    sessions = [JobSession(spec, "auto", tmp_path / f"s{n}", warm_cache=False) for n in (0, 1)]
    store = dist.HashStore()
    reports = [NodeReport(0, (1,), (0,), True, reported=3), NodeReport(1, (3,), (2,), True,
                                                                        reported=3)]
    raised: dict[int, BaseException] = {}

    def agent(node: int) -> None:
        try:
            protocol.agree(store, "r1/", messages.Members(node, (0, 1)), reports[node],
                           sessions[node], True, 2, timeout_s=30)
        except LauncherPlanningError as exc:
            raised[node] = exc

    thread = threading.Thread(target=agent, args=(1,))
    thread.start()
    agent(0)
    thread.join(30)
    assert not thread.is_alive(), "the follower never read the decider's error"
    assert sorted(raised) == [0, 1]
    for exc in raised.values():
        assert "layers 4-7 were lost with every device that held them" in str(exc)
        assert exc.status == ExitStatus.DO_NOT_REQUEUE


def test_only_the_decider_of_a_quick_round_reads_the_plan_record(session, tmp_path):
    """The record holds the whole plan (0.6 MB at 8192 devices). Every member reading it at
    the start of a quick round made etcd send 0.6 GB before the first report at 1024 nodes
    (benchmarks/coordination_scale.py), and the decision the others adopt was made from it
    anyway. The follower still ends on the decider's plan, replayed from the same digest:
    it reads no plan at all, only the agreement."""
    import threading

    fence = _Reads(dist.HashStore())
    protocol.commit_record(fence, "", deciding.decide(
        session.plan, (), [NodeReport(0, (), (0, 1), True), NodeReport(1, (), (2, 3), True)],
        True))
    store = _Reads(dist.HashStore(), fence)
    follower = JobSession(JobSpec.preset("tiny-cpu"), "auto", tmp_path / "f", warm_cache=False)
    result: dict = {}

    def follow() -> None:
        result["decision"], _, _ = protocol.agree(
            store, "q1/", messages.Members(1, (0, 1), alive=lambda: {0, 1}),
            NodeReport(1, (3,), (2,), True), follower, True, 2, timeout_s=30, quick=True)

    thread = threading.Thread(target=follow, name="follower")
    thread.start()
    decision, _, decided = protocol.agree(
        store, "q1/", messages.Members(0, (0, 1), alive=lambda: {0, 1}),
        NodeReport(0, (), (0, 1), True), session, True, 2, timeout_s=30, quick=True)
    assert decided
    thread.join(30)
    assert not thread.is_alive(), "the follower never adopted the decision"
    record_readers = {who for who, _, keys in fence.reads if protocol.RECORD in keys}
    assert record_readers == {threading.current_thread().name}   # the decider only
    assert result["decision"] == decision and set(decision.excluded) == {3}
    assert follower.plan == session.plan and follower.excluded == {3}


def test_the_others_wait_on_the_agreement_itself(session):
    """The agreement is what the others wait on (on etcd the watch event that wakes them
    carries it, and their read takes it from there: no marker put, no read per agent); it is
    written once: a second publication (a replaced decider's) fails the round."""
    store = dist.HashStore()
    _, agreement = _published(session, [NodeReport(0, (1,), (0, 2, 3), True)], {1})
    with pytest.raises(dist.DistStoreError):
        protocol.read_agreement(store, "r1/", timeout_s=0.2)
    protocol.publish(store, "r1/", agreement)
    assert not store.check(["r1/decided"])
    assert protocol.read_agreement(store, "r1/", timeout_s=5) == agreement
    with pytest.raises(messages.QuickRoundFailed):
        protocol.publish(store, "r1/", replace(agreement, digest="another"))


def test_a_node_without_the_reporter_knows_the_reported_steps_from_its_workers_commits():
    """The reporter's node is gone: the survivors' report still says which steps the job had
    reported (one before the last their own workers committed), so a start over from step 0
    says it trains them again instead of nothing."""
    import json

    from chameleon_elastic import channel

    store = dist.HashStore()
    assert NodeReport.gather(1, (), (2,), True, {}, store, cards=(2, 3)).reported is None
    store.set(channel.steps_key(2), json.dumps({"recent": [[11, 0.2], [12, 0.2]]}))
    store.set(channel.steps_key(3), json.dumps({"recent": [[10, 0.2]]}))
    assert NodeReport.gather(1, (), (2,), True, {}, store, cards=(2, 3)).reported == 11
    channel.write(store, channel.REPORTED, 12)   # the reporter runs here: its word counts
    assert NodeReport.gather(1, (), (2,), True, {}, store, cards=(2, 3)).reported == 12


def test_trouble_keeps_the_newest_generation_whoever_writes_last():
    """A worker failing a superseded generation says so after a peer reported trouble with
    the current one: the agent must still see the current one."""
    from chameleon_elastic import channel

    store = dist.HashStore()
    channel.write_max(store, channel.TROUBLE, 2)
    channel.write_max(store, channel.TROUBLE, 1)
    assert channel.read_int(store, channel.TROUBLE) == 2
    channel.write_max(store, channel.TROUBLE, 3)
    assert channel.read_int(store, channel.TROUBLE) == 3


def test_a_quick_rounds_report_opens_it_for_the_agents_that_have_not_seen_its_cause():
    """The key that wakes the other agents comes with the first report, in the same write:
    opening the round writes nothing by itself, and one report is enough."""
    from types import SimpleNamespace

    from chameleon_elastic.launcher.coordination.rounds import Rounds
    from chameleon_elastic.launcher.observe import StatusLine
    from chameleon_elastic.timeouts import Timeouts

    class Counting(dist.HashStore):
        writes = 0

        def set(self, *args):
            Counting.writes += 1
            return super().set(*args)

        def multi_set(self, *args):
            Counting.writes += 1
            return super().multi_set(*args)

    store = Counting()
    agents = []
    for node in (0, 1):
        rounds = Rounds(SimpleNamespace(backend="etcd-v3", max_nodes=2), Timeouts(store_s=2),
                        StatusLine(enabled=False), lambda *a, **k: None)
        rounds._last_info, rounds.nodes = SimpleNamespace(store=store), (0, 1)
        agents.append(rounds)
    assert not agents[1].quick_called()
    _, members = agents[0].quick(0, None)
    assert Counting.writes == 0 and not agents[1].quick_called()
    protocol.report(store, agents[0].scope(), members.me, NodeReport(0, (), (0, 1), True),
                    opens=True)
    assert Counting.writes == 1 and agents[1].quick_called()


def test_a_read_racing_a_delete_sees_the_value_or_nothing_and_never_waits():
    """A worker deletes its slow-stretch key while its agent reads it: the agent must get the
    value or None. A check then a get returned empty bytes here (CI: an agent failed on a JSON
    error) or waited out the store's timeout; a missing key is not created by reading it."""
    import threading
    from datetime import timedelta

    from chameleon_elastic import channel

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=10))
    writer = dist.TCPStore("127.0.0.1", store.port, is_master=False,
                           timeout=timedelta(seconds=10))
    stop, seen = threading.Event(), set()

    def flip() -> None:
        while not stop.is_set():
            channel.write(writer, "slow/0", {"deadline_s": 3.0})
            writer.delete_key("slow/0")

    thread = threading.Thread(target=flip, daemon=True)
    thread.start()
    try:
        for _ in range(3000):
            found = channel.read(store, "slow/0")
            seen.add(None if found is None else found["deadline_s"])
    finally:
        stop.set()
        thread.join(timeout=10)
    assert seen <= {None, 3.0}
    assert channel.read(store, "never/written") is None
    assert not store.check(["never/written"])


def test_a_stored_decision_is_compressed_checked_and_an_older_plain_record_still_read(session):
    """The decision and the fenced record are stored compressed (every agent of a quick round
    reads the plan); a record an older agent wrote as plain JSON is still read and fenced over,
    and a damaged value is refused rather than taken for a plan."""
    session.apply(lost={2})
    d = Decision(session.plan, (2,), (0, 1, 3), True, 4, None)
    assert len(d.encode()) < len(d.to_json()) and Decision.decode(d.encode()) == d
    fence = dist.HashStore()
    fence.set(protocol.RECORD, d.to_json())   # written before compression
    seen, newest = protocol.read_record(fence)
    assert newest == d
    session.apply(lost={3})
    later = Decision(session.plan, (2, 3), (0, 1), True, 4, None)
    protocol.commit_record(fence, seen, later)
    assert protocol.read_record(fence)[1] == later
    with pytest.raises(messages.Fenced):   # the plain record it replaced is stale now
        protocol.commit_record(fence, d.to_json(), d)
    damaged = bytearray(later.encode())
    damaged[len(damaged) // 2] ^= 0xFF
    with pytest.raises(LauncherPlanningError, match="damaged"):
        Decision.decode(bytes(damaged))


class _CountingDesk:
    """The launcher's desk (a worker store on loopback, as the deciding agent hosts it), with
    the fetches noted."""

    def __init__(self):
        from datetime import timedelta

        from chameleon_elastic.launcher.coordination.rounds import WorkerStoreDesk

        self.server = None
        self.fetched: list[str] = []

        def serve():
            if self.server is None:
                self.server = dist.TCPStore("127.0.0.1", 0, is_master=True,
                                            wait_for_workers=False)
            return "127.0.0.1", self.server

        self._inner = WorkerStoreDesk(serve, timedelta(seconds=5))

    def offer(self, blob):
        return self._inner.offer(blob)

    def fetch(self, source):
        self.fetched.append(source)
        return self._inner.fetch(source)


def test_a_late_joiner_fetches_the_plan_from_the_decider_never_from_the_store(session, tmp_path):
    """A full round after a node came back: the decider catches up from the record
    (generation 1) and decides; the returning node still holds generation 0, so replaying the
    step from its own digest cannot work. It fetches the whole decision from the deciding
    agent's desk (the worker store it hosts): from neither the round's store nor the record."""
    import threading

    previous = JobSession(JobSpec.preset("tiny-cpu"), "auto", tmp_path / "p", warm_cache=False)
    fence = _Reads(dist.HashStore())
    first, _ = _published(previous, [NodeReport(0, (1,), (0,), True)], {1})
    protocol.commit_record(fence, "", first)
    store = _Reads(dist.HashStore(), fence)
    desk = _CountingDesk()
    joiner = JobSession(JobSpec.preset("tiny-cpu"), "auto", tmp_path / "j", warm_cache=False)
    result: dict = {}

    def follow() -> None:
        result["follower"] = protocol.agree(
            store, "r2/", messages.Members(1, (0, 1)), NodeReport(1, (), (2, 3), True),
            joiner, True, 2, timeout_s=30, desk=desk)

    thread = threading.Thread(target=follow, name="joiner")
    thread.start()
    decision, _, decided = protocol.agree(
        store, "r2/", messages.Members(0, (0, 1)), NodeReport(0, (1,), (0,), True),
        session, True, 2, timeout_s=30, desk=desk)
    thread.join(30)
    assert not thread.is_alive(), "the returning node never adopted the decision"
    assert decided and decision.plan.generation == first.plan.generation + 1
    adopted, change, follower_decided = result["follower"]
    assert not follower_decided and adopted == decision
    assert joiner.plan == session.plan and joiner.excluded == {1}
    assert joiner.digest == session.digest
    assert change is not None and change.lost == (1,)   # what the joiner learns was lost
    assert change.agreed == "fetched"
    assert len(desk.fetched) == 1
    joiner_reads = [keys for who, _, keys in store.reads + fence.reads if who == "joiner"]
    assert all("decision" in str(k) for k in joiner_reads), joiner_reads


def test_a_replay_whose_decider_is_gone_fails_the_round_not_the_agent(session, tmp_path):
    """The decider died after publishing, and this agent's replay differs: it cannot fetch the
    plan, and the round fails (the agent then runs a full round, whose decider starts from
    the record) instead of the agent ending or guessing."""
    desk = _CountingDesk()
    decision, agreement = _published(session, [NodeReport(0, (1,), (0, 2, 3), True)], {1})
    agreement = replace(agreement, source=desk.offer(decision.encode()))
    stale = JobSession(JobSpec.preset("tiny-cpu"), "auto", tmp_path / "s", warm_cache=False)
    stale.apply(lost={2})   # another history: its digest is not the agreement's base
    desk.server = None      # the deciding agent is gone, its store with it
    import gc

    gc.collect()
    with pytest.raises(messages.PlanUnreachable, match="full rendezvous round"):
        protocol.adopt(agreement, stale, desk)
    assert isinstance(messages.PlanUnreachable("x"), messages.QuickRoundFailed)


def test_the_agreement_stays_small_as_the_job_grows(tmp_path):
    """What every agent reads per recovery is the agreement: its size must not follow the
    plan's (which grows with the devices), so that etcd's traffic per recovery is the nodes
    times a report's size."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from planner_latency import spec_for

    sizes = {}
    for devices in (64, 1024):
        s = JobSession(spec_for(devices), "auto", tmp_path / str(devices), cache_depth=0)
        reports = [NodeReport(n, (), tuple(range(8 * n, 8 * n + 8)), True)
                   for n in range(devices // 8) if n != 3]   # node 3 is gone
        lost, _ = deciding.losses(reports, (), devices, 8)
        decision, agreement = _published(s, reports, lost)
        sizes[devices] = (len(decision.encode()), len(agreement.encode()))
        assert Agreement.decode(agreement.encode()) == agreement
    assert sizes[1024][0] > 8 * sizes[64][0], sizes            # the plan grows with the job
    assert sizes[1024][1] < 1.5 * sizes[64][1] < 3000, sizes   # the agreement does not


def test_a_follower_with_a_warm_plan_cache_replays_a_cold_deciders_plan(tmp_path):
    """Agents decide with or without their plan cache (warmed in the background): the cache
    must lead to the very plan the planner builds, or every follower would fetch it."""
    cold = JobSession(JobSpec.preset("tiny-cpu"), "auto", tmp_path / "c", cache_depth=0)
    warm = JobSession(JobSpec.preset("tiny-cpu"), "auto", tmp_path / "w", warm_cache=False)
    assert warm._cache is not None and warm._cache.warm() > 0
    for lost in ({1}, {1, 2}):
        base = cold.digest
        assert warm.digest == base
        cold.step(lost, (), {}, True)
        change = warm.step(lost, (), {}, True)
        assert change is not None and change.cached
        assert warm.digest == cold.digest, f"the cached plan differs after losing {lost}"
        warm.warm()


def test_a_lost_standby_keeps_the_plan_and_its_generation_and_every_agent_replays_it(tmp_path):
    """Standbys (spares outside the training world) hold no layers and take part in no
    collective: the decider says the loss is quiet, the plan in force is kept with one spare
    fewer and the same generation (no worker hears of it), and an agent that replays the
    agreement reaches the same digest. The same device inside the world (a spare that votes in
    every step) is no standby: its loss makes a new generation."""
    spec = JobSpec.preset("tiny-cpu-standby")
    decider = JobSession(spec, "auto", tmp_path / "a", warm_cache=False)
    follower = JobSession(spec, "auto", tmp_path / "b", warm_cache=False)
    before = decider.plan
    assert before.spare_devices == (4, 5)
    store = dist.HashStore()
    reports = [NodeReport(0, (), (0, 1), True, reported=11), NodeReport(1, (), (2, 3), True),
               NodeReport(2, (5,), (), True)]
    for r in reports:
        protocol.report(store, "r/", r.node, r)
    members = messages.Members(0, (0, 1, 2))
    decision, change, decided = protocol.agree(store, "r/", members, reports[0], decider, True,
                                               2, 5.0, standbys={4, 5})
    assert decided and decision.quiet and decision.starting == ()
    assert change.quiet and change.lost == (5,) and change.idle_lost == (5,)
    assert decider.plan.generation == before.generation   # no generation for the workers
    assert decider.plan.pipelines == before.pipelines and decider.plan.spare_devices == (4,)
    assert decision.world == (0, 1, 2, 3) and decider.excluded == {5}
    adopted, replayed = protocol.adopt(protocol.read_agreement(store, "r/"), follower, None)
    assert adopted.quiet and replayed.agreed == "replayed" and replayed.quiet
    assert follower.digest == decider.digest
    # inside the world, the same loss is not quiet: the workers' world must be formed again
    assert not deciding.quiet_loss({5}, (), set(), standbys={4})
    assert not deciding.quiet_loss({5}, {4}, set(), standbys={4, 5})   # one back: a change
    assert deciding.quiet_loss({3, 5}, (), {3}, standbys={4, 5})       # 3 was lost before


def test_a_late_agent_catches_up_with_a_quiet_decision_of_its_own_generation(tmp_path):
    """A quiet decision keeps the generation: the record's plan is still newer than a stale
    agent's plan of that generation, and the agent that decides next must start from it (or it
    would offer a lost standby again)."""
    spec = JobSpec.preset("tiny-cpu-standby")
    decider = JobSession(spec, "auto", tmp_path / "a", warm_cache=False)
    stale = JobSession(spec, "auto", tmp_path / "b", warm_cache=False)
    decider.step({5}, (), {}, renew=True, quiet=True)
    fence = dist.HashStore()
    record = deciding.decide(decider.plan, decider.excluded, [NodeReport(0, (), (0, 1), True)],
                             True, quiet=True)
    protocol.commit_record(fence, "", record)
    protocol._catch_up(fence, stale)
    assert stale.plan == decider.plan and stale.excluded == {5}


class _EtcdInTrouble:
    """A round's store on etcd that never serves a request (a leader change that outlasts the
    round), with ``EtcdStore.retrying_until``: the bounds the round set are noted."""

    def __init__(self, underlying=None):
        self.bounds: list[float] = []
        if underlying is not None:
            self.underlying_store = underlying

    def retrying_until(self, deadline: float):
        import contextlib

        self.bounds.append(deadline)
        return contextlib.nullcontext()

    def __getattr__(self, name):
        from chameleon_elastic.rendezvous.errors import EtcdConnectionError

        def refused(*args, **kwargs):
            raise EtcdConnectionError(
                f"etcd store {name} failed: the cluster at 127.0.0.1:2379 answered but could "
                "not serve it within the round's deadline (last answer: UNAVAILABLE: "
                "etcdserver: leader changed)")

        return refused


def test_a_round_that_etcd_could_not_serve_fails_as_a_round_not_as_the_agent(session):
    """Every request of the round retries etcd's trouble until the round's own deadline (the
    store under the round bounds them: issue 48); a round etcd could not serve by then is a
    failed round, which the agent follows with a full rendezvous round, not an agent's end."""
    import time

    fence = _EtcdInTrouble()
    store = _EtcdInTrouble(fence)
    before = time.monotonic()
    with pytest.raises(messages.QuickRoundFailed, match="etcd could not serve this round"):
        protocol.agree(store, "q1/", messages.Members(0, (0, 1), alive=lambda: {0, 1}),
                       NodeReport(0, (), (0, 1), True), session, True, 2, timeout_s=30,
                       quick=True)
    (bound,) = fence.bounds
    assert before + 30 <= bound <= time.monotonic() + 30
