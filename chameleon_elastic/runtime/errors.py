"""The runtime's exception types, so callers can tell our failures from torch's, and the one rule
for catching a lost peer (:func:`keep_message_only`)."""

from __future__ import annotations

import sys
from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["DeviceContextLost", "LostPeerMessage", "PeerLost", "PipelineRuntimeError",
           "communication_failure", "keep_message_only", "say_peer_loss_in_one_line"]

#: How a broken collective reads where torch gives it no type: gloo's errors are bare
#: ``RuntimeError``s in torch 2.13 (``[.../third_party/gloo/gloo/transport/tcp/pair.cc:553]
#: Connection closed by peer``, ``Timed out waiting 3000ms for recv operation to complete``,
#: ``Application timeout caused pair closure``), and so are torch_npu's HCCL errors. NCCL's
#: errors and the stores' have types (:func:`communication_failure`). A generic "timed out" in
#: a script's own error is not a lost peer: taken for one, it would be recovered from forever.
_UNTYPED_BROKEN_LINK = ("/gloo/", "Gloo", "Connection closed by peer", "Connection reset by peer",
                        "Broken pipe", "Timed out waiting",
                        "Application timeout caused pair closure", "HCCL")


class PipelineRuntimeError(RuntimeError):
    """Training under a plan cannot go on; the message names the problem and the fix."""


class PeerLost(PipelineRuntimeError):
    """A transfer or collective broke because a peer is gone, or because a peer tore its
    process groups down to recover (or the agent announced a new plan generation). Under
    chameleon-run this starts an in-place recovery; it reaches the user only without an agent
    to regroup with (plain torchrun, tests)."""


class DeviceContextLost(PipelineRuntimeError):
    """This process can never use its device again (a CUDA sticky error: a device-side assert,
    an illegal address): it exits to be restarted alone, as a crashed worker is, while its
    peers recover in place. Raised instead of recovering in place; the message says why."""


class LostPeerMessage:
    """The message of a :class:`PeerLost` raised inside a ``with`` block; see
    :func:`keep_message_only`."""

    def __init__(self, catch: bool) -> None:
        self.catch = catch
        self.message: str | None = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        if self.catch and isinstance(exc, PeerLost):
            self.message = str(exc)
            return True
        return False


def keep_message_only(catch: bool = True) -> LostPeerMessage:
    """Catch a :class:`PeerLost` (when ``catch``; else let it through) and keep only its message.

    Why only the message: the exception's traceback holds the frames of the broken step, whose
    pending work keeps the old process groups, and with them their sockets, alive; a peer
    blocked on those sockets would then wait for its collective timeout instead of failing at
    once (docs/runtime.md, *Teardown must close sockets*). Every place that goes on to recover
    after a lost peer catches it through this::

        with keep_message_only(recovering) as lost:
            ...
        if lost.message is not None:
            recover(lost.message)
    """
    return LostPeerMessage(catch)


def communication_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a broken collective or transfer (a lost peer), not a bug: by its type
    where torch gives one (``DistError``: ``DistBackendError`` from NCCL, ``DistNetworkError``
    and ``DistStoreError`` from the stores), by its words for the back-ends that give none."""
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    return type(exc) is RuntimeError and any(s in str(exc) for s in _UNTYPED_BROKEN_LINK)


def say_peer_loss_in_one_line(device: int) -> None:
    """Under chameleon-run, a script that drives ``trainer.step`` itself ends on the
    :class:`PeerLost` of a lost peer; the launcher handles that loss (it re-plans and relaunches
    the script), so the survivor's exit must not look like a crash: one line instead of the
    traceback. Any other exception keeps the previous hook (torch's rank-prefixed one)."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if isinstance(exc, PeerLost):
            first = str(exc).splitlines()[0] if str(exc) else kind.__name__
            sys.stderr.write(f"device {device}: stopped, a peer was lost ({first[:200]}); "
                             "chameleon-run handles the loss\n")
            return
        previous(kind, exc, tb)

    sys.excepthook = hook
