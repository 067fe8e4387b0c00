"""The plan record and a round's agreement on a real etcd, as the agents store them: the
record compressed, fenced by compare-and-set on the compressed bytes; the agreement published
and read through torch's PrefixStore (launcher/coordination/agreement.py)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from chameleon_elastic.launcher.coordination import agreement as protocol
from chameleon_elastic.launcher.coordination import decide as deciding
from chameleon_elastic.launcher.coordination import messages
from chameleon_elastic.launcher.coordination.messages import Decision, NodeReport
from chameleon_elastic.launcher.session import JobSession
from chameleon_elastic.rendezvous.store import EtcdStore
from chameleon_elastic.spec import JobSpec

pytestmark = pytest.mark.timeout(60)


def _decision(session: JobSession, lost: set[int]) -> Decision:
    session.apply(lost=lost)
    live = [d for d in range(4) if d not in session.excluded]
    return deciding.decide(session.plan, session.excluded,
                               [NodeReport(0, tuple(sorted(lost)), tuple(live), True)], True)


def test_a_compressed_decision_is_fenced_published_and_adopted_on_etcd(
        etcd_client, run_prefix, tmp_path) -> None:
    fence = EtcdStore(etcd_client, run_prefix, timeout=timedelta(seconds=10))
    store = dist.PrefixStore("torch.rendezvous.r.0", fence)
    session = JobSession(JobSpec.preset("tiny-cpu"), "auto", tmp_path / "a", warm_cache=False)
    plain = _decision(session, {1})
    fence.set(protocol.RECORD, plain.to_json())   # an older agent's plain record
    seen, newest = protocol.read_record(fence)
    assert newest == plain
    second = _decision(session, {1, 3})
    protocol.commit_record(fence, seen, second)
    assert bytes(fence.get(protocol.RECORD)) == second.encode()   # stored compressed
    with pytest.raises(messages.Fenced, match="published meanwhile"):
        protocol.commit_record(fence, seen, plain)   # a stale view cannot publish
    assert protocol.read_record(fence)[1] == second
    agreement = messages.Agreement.of(second, base="b", digest="d", lost=(1, 3))
    protocol.publish(store, "q1/", agreement)
    assert protocol.read_agreement(store, "q1/", timeout_s=5) == agreement
