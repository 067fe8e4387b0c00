"""Receiving a stage's messages where the back-end matches them first-in first-out.

Gloo matches a point-to-point message by its tag, so a receive takes exactly the tensor it
names. NCCL and HCCL ignore tags: the n-th receive from a peer gets the n-th message that peer
sent. After a reroute of asymmetric pipelines a device may consume a peer's messages in
another order than the peer sent them (``schedule.fifo_violations``). On such back-ends every
link is therefore read in its send order (``schedule.link_messages``): to get the message it
needs, a device receives the link's next messages in turn, keeping those it does not need yet
until their operation asks for them.

Why this cannot deadlock where tag matching does not: a message sent before the one a device
waits for has been sent by the time that one is, so reading the link in order completes
exactly when the wanted message arrives. What it costs: the messages received early stay in
memory until used (on the links that need it; elsewhere the send order is the use order and
nothing waits).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ..errors import PipelineRuntimeError

__all__ = ["FifoInbox"]

#: one message: its tag and the spec of the buffer it arrives in
Message = tuple[int, Any]


class FifoInbox:
    """One step's receives on FIFO links. ``links``: per sending device, the operations whose
    outputs it sends here, in its order; ``messages(op)``: the tagged messages one such
    operation sends (a stage boundary is one message per tensor); ``receive(spec, source)``:
    the back-end's receive of the next message from ``source``."""

    def __init__(self, links: Mapping[int, Iterable[Any]],
                 messages: Callable[[Any], list[Message]],
                 receive: Callable[[Any, int], torch.Tensor]) -> None:
        self._ops = {source: iter(ops) for source, ops in links.items()}
        self._queued: dict[int, deque[Message]] = {source: deque() for source in links}
        self._messages = messages
        self._receive = receive
        self._early: dict[tuple[int, int], torch.Tensor] = {}

    def take(self, source: int, tag: int) -> torch.Tensor:
        """The message ``tag`` from ``source``, reading that link in its send order."""
        while (source, tag) not in self._early:
            queued = self._queued.get(source)
            if queued is None:
                raise PipelineRuntimeError(
                    f"internal: no operation sends here from device {source} under this plan")
            if not queued:
                op = next(self._ops[source], None)
                if op is None:
                    raise PipelineRuntimeError(
                        f"internal: device {source} sends no message tagged {tag} here")
                queued.extend(self._messages(op))
                continue
            next_tag, spec = queued.popleft()
            self._early[(source, next_tag)] = self._receive(spec, source)
        return self._early.pop((source, tag))

    @property
    def held(self) -> int:
        """Messages received ahead of their use, not taken yet."""
        return len(self._early)
