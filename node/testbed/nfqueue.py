"""nfnetlink_queue, the few messages a packet-delay daemon needs, and the delay schedule itself. No I/O here.

Why this exists: the kernel here has no ``tc netem``. A link gets latency by sending its packets to an NFQUEUE
(iptables ``-j NFQUEUE``, never ``--queue-bypass``) and having a user-space program hand back a verdict N ms later.
The program copies metadata only (``NFQNL_COPY_META``: no payload crosses into user space) and releases packets
with one batch verdict (``NFQNL_MSG_VERDICT_BATCH``: "accept every queued id up to X"), so its cost per packet is a
few hundred bytes of netlink, not a copy of the packet.

Layout (``linux/netfilter/nfnetlink_queue.h``): a netlink header and attribute headers in host byte order, then
``struct nfgenmsg`` {u8 family, u8 version, be16 res_id = queue number}, then attributes whose payload structs
are big-endian. Builders return bytes; ``parse`` turns bytes from the socket into events; ``DelayLine`` says when
each packet is due, from an injected clock. ``delayd.py`` moves the bytes.
"""

from __future__ import annotations

import random
import socket
import struct
from collections import deque
from dataclasses import dataclass
from enum import IntEnum

from .errors import NetlinkError, NetlinkFormatError

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFNETLINK_V0 = 0

NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NLMSG_ERROR = 2
NLA_TYPE_MASK = 0x3FFF  # strips NLA_F_NESTED / NLA_F_NET_BYTEORDER

_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_NFGENMSG = struct.Struct("!BBH")  # family, version, res_id (queue number, big-endian)
_NLATTR = struct.Struct("=HH")  # len, type
_PACKET_HDR = struct.Struct("!IHB")  # packet_id, hw_protocol, hook
_VERDICT_HDR = struct.Struct("!II")  # verdict, id
MAX_QUEUE = 0xFFFF


class QueueMsg(IntEnum):
    PACKET = 0
    VERDICT = 1
    CONFIG = 2
    VERDICT_BATCH = 3


class Attr(IntEnum):
    PACKET_HDR = 1
    VERDICT_HDR = 2


class CfgAttr(IntEnum):
    CMD = 1
    PARAMS = 2
    QUEUE_MAXLEN = 3
    MASK = 4
    FLAGS = 5


class CfgCmd(IntEnum):
    BIND = 1
    UNBIND = 2


class Verdict(IntEnum):
    DROP = 0
    ACCEPT = 1


COPY_META = 1
CFG_F_FAIL_OPEN = 1 << 0  # never set: a full queue must drop, not pass packets undelayed
CFG_F_GSO = 1 << 2  # hand over GSO packets whole; we never look at the payload


def _msg_type(msg: QueueMsg) -> int:
    return (NFNL_SUBSYS_QUEUE << 8) | msg


def _attr(kind: int, payload: bytes) -> bytes:
    pad = -len(payload) % 4
    return _NLATTR.pack(_NLATTR.size + len(payload), kind) + payload + b"\0" * pad


def _message(msg: QueueMsg, queue: int, attrs: bytes, seq: int, flags: int) -> bytes:
    if not 0 <= queue <= MAX_QUEUE:
        raise ValueError(f"queue number {queue} is outside 0..{MAX_QUEUE}")
    body = _NFGENMSG.pack(socket.AF_UNSPEC, NFNETLINK_V0, queue) + attrs
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), _msg_type(msg), flags, seq, 0) + body


def bind_request(queue: int, seq: int) -> bytes:
    """Become the listener of `queue` (fails with EBUSY if another socket holds it)."""
    cmd = struct.pack("!BBH", CfgCmd.BIND, 0, socket.AF_INET)
    return _message(QueueMsg.CONFIG, queue, _attr(CfgAttr.CMD, cmd), seq, NLM_F_REQUEST | NLM_F_ACK)


def params_request(queue: int, seq: int, maxlen: int) -> bytes:
    """Metadata-only copies, a queue of `maxlen` packets, GSO packets whole, and no fail-open."""
    flags = struct.pack("!I", CFG_F_GSO)
    attrs = (
        _attr(CfgAttr.PARAMS, struct.pack("!IB", 0, COPY_META))
        + _attr(CfgAttr.QUEUE_MAXLEN, struct.pack("!I", maxlen))
        + _attr(CfgAttr.MASK, struct.pack("!I", CFG_F_GSO | CFG_F_FAIL_OPEN))
        + _attr(CfgAttr.FLAGS, flags)
    )
    return _message(QueueMsg.CONFIG, queue, attrs, seq, NLM_F_REQUEST | NLM_F_ACK)


def verdict(queue: int, packet_id: int, decision: Verdict, seq: int = 0) -> bytes:
    """The verdict for one packet (used to drop a packet the loss model picked)."""
    return _message(QueueMsg.VERDICT, queue, _attr(Attr.VERDICT_HDR, _VERDICT_HDR.pack(decision, packet_id)), seq, NLM_F_REQUEST)


def batch_verdict(queue: int, upto_id: int, decision: Verdict, seq: int = 0) -> bytes:
    """One verdict for every packet still queued whose id is not after `upto_id` (ids wrap at 2**32)."""
    hdr = _VERDICT_HDR.pack(decision, upto_id)
    return _message(QueueMsg.VERDICT_BATCH, queue, _attr(Attr.VERDICT_HDR, hdr), seq, NLM_F_REQUEST)


@dataclass(frozen=True)
class Packet:
    """The kernel queued a packet: only its id and queue matter for a fixed delay."""

    queue: int
    packet_id: int


@dataclass(frozen=True)
class Ack:
    """The kernel acknowledged request `seq` (errno 0) or refused it (``NetlinkError`` is raised instead)."""

    seq: int


def _attrs(data: bytes, start: int, end: int) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    off = start
    while off + _NLATTR.size <= end:
        length, kind = _NLATTR.unpack_from(data, off)
        if length < _NLATTR.size or off + length > end:
            raise NetlinkFormatError(f"attribute length {length} at offset {off} overruns its message")
        out[kind & NLA_TYPE_MASK] = data[off + _NLATTR.size : off + length]
        off += (length + 3) & ~3
    return out


def parse(data: bytes) -> list[Packet | Ack]:
    """Events in one datagram read from the socket (a datagram may hold several netlink messages)."""
    events: list[Packet | Ack] = []
    off = 0
    while off + _NLMSGHDR.size <= len(data):
        length, kind, _flags, seq, _pid = _NLMSGHDR.unpack_from(data, off)
        if length < _NLMSGHDR.size or off + length > len(data):
            raise NetlinkFormatError(f"netlink message length {length} at offset {off} overruns the datagram of {len(data)} bytes")
        body = off + _NLMSGHDR.size
        if kind == NLMSG_ERROR:
            if length < _NLMSGHDR.size + 4:
                raise NetlinkFormatError("netlink error message without an error code")
            (err,) = struct.unpack_from("=i", data, body)
            if err:
                raise NetlinkError(-err, seq)
            events.append(Ack(seq))
        elif kind == _msg_type(QueueMsg.PACKET):
            if length < _NLMSGHDR.size + _NFGENMSG.size:
                raise NetlinkFormatError("queued-packet message without its nfgenmsg header")
            _family, _version, queue = _NFGENMSG.unpack_from(data, body)
            hdr = _attrs(data, body + _NFGENMSG.size, off + length).get(Attr.PACKET_HDR)
            if hdr is None or len(hdr) < _PACKET_HDR.size:
                raise NetlinkFormatError("queued-packet message without a packet header attribute")
            events.append(Packet(queue, _PACKET_HDR.unpack_from(hdr)[0]))
        # NLMSG_NOOP / NLMSG_DONE / other subsystems: nothing to do
        off += (length + 3) & ~3
    return events


class DelayLine:
    """Holds packet ids for a fixed delay, first in first out, and drops a share of them at random.

    A fixed delay keeps release order equal to arrival order, so everything due is released by one batch verdict
    naming the last due id. A dropped packet is answered at once and never enters the line.
    """

    def __init__(self, delay: float, loss: float = 0.0, rng: random.Random | None = None):
        if delay < 0:
            raise ValueError(f"delay must be >= 0, got {delay}")
        if not 0.0 <= loss < 1.0:
            raise ValueError(f"loss must be in [0, 1), got {loss}")
        self.delay = delay
        self.loss = loss
        self._rng = rng or random.Random()
        self._line: deque[tuple[float, int]] = deque()
        self.accepted = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._line)

    def arrive(self, packet_id: int, now: float) -> bool:
        """Queue a packet seen at `now`; False means drop it now."""
        if self.loss and self._rng.random() < self.loss:
            self.dropped += 1
            return False
        self._line.append((now + self.delay, packet_id))
        return True

    def next_deadline(self) -> float | None:
        return self._line[0][0] if self._line else None

    def release(self, now: float) -> int | None:
        """Remove every packet due by `now`; the id to name in one batch verdict, or None if none is due."""
        last = None
        while self._line and self._line[0][0] <= now:
            last = self._line.popleft()[1]
            self.accepted += 1
        return last
