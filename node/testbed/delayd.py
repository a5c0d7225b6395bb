"""The per-link delay daemon: ``python -m node.testbed.delayd --delay-ms 40 [--loss 0.01]`` inside a namespace.

It binds NFQUEUE `--queue` of the namespace it runs in, prints ``ready`` on stdout once bound, then holds every
queued packet for the delay and releases due packets with one batch verdict. Only the socket loop lives here; the
messages and the schedule are in ``nfqueue.py``.

If this process dies the kernel has no listener for the queue and, since the rule has no ``--queue-bypass``, drops
the link's packets: a dead daemon shows up as a dead link, never as a fast one.
"""

from __future__ import annotations

import argparse
import errno
import random
import select
import signal
import socket
import sys
import time

import structlog

from node.logs import configure_logging

from .errors import NetlinkError
from .nfqueue import NETLINK_NETFILTER, Ack, DelayLine, Packet, Verdict, batch_verdict, bind_request, params_request, parse, verdict

log = structlog.get_logger("node.testbed.delayd")

SOL_NETLINK = 270
NETLINK_NO_ENOBUFS = 5
RCVBUF = 8 << 20
QUEUE_MAXLEN = 16384
READ_SIZE = 1 << 16


def open_queue(queue: int) -> socket.socket:
    """A netlink socket bound to `queue` with metadata-only copies; raises NetlinkError if the kernel refuses."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    try:
        sock.setsockopt(socket.SOL_SOCKET, 33, RCVBUF)  # SO_RCVBUFFORCE: root may exceed rmem_max
        sock.setsockopt(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1)
        sock.bind((0, 0))
        for seq, request in enumerate((bind_request(queue, 1), params_request(queue, 2, QUEUE_MAXLEN)), start=1):
            sock.send(request)
            _wait_ack(sock, seq)
    except BaseException:
        sock.close()
        raise
    return sock


def _wait_ack(sock: socket.socket, seq: int) -> None:
    while True:
        for event in parse(sock.recv(READ_SIZE)):
            if isinstance(event, Ack) and event.seq == seq:
                return


def serve(sock: socket.socket, queue: int, line: DelayLine, clock=time.monotonic) -> None:
    """Delay packets until the process is stopped."""
    while True:
        deadline = line.next_deadline()
        timeout = None if deadline is None else max(0.0, deadline - clock())
        readable, _, _ = select.select([sock], [], [], timeout)
        if readable:
            _drain(sock, queue, line, clock)
        upto = line.release(clock())
        if upto is not None:
            sock.send(batch_verdict(queue, upto, Verdict.ACCEPT))


def _drain(sock: socket.socket, queue: int, line: DelayLine, clock) -> None:
    while True:
        try:
            data = sock.recv(READ_SIZE, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        now = clock()
        for event in parse(data):
            if isinstance(event, Packet) and not line.arrive(event.packet_id, now):
                sock.send(verdict(queue, event.packet_id, Verdict.DROP))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m node.testbed.delayd", description=__doc__.splitlines()[0])
    ap.add_argument("--queue", type=int, default=0)
    ap.add_argument("--delay-ms", type=float, required=True)
    ap.add_argument("--loss", type=float, default=0.0, help="share of packets dropped, 0 <= loss < 1")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)
    configure_logging("info")  # stderr: stdout carries only the ready line
    line = DelayLine(args.delay_ms / 1000.0, args.loss, random.Random(args.seed))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        sock = open_queue(args.queue)
    except NetlinkError as exc:
        hint = " (another daemon holds this queue)" if exc.errno == errno.EBUSY else ""
        print(f"error: cannot bind NFQUEUE {args.queue}: {exc}{hint}", file=sys.stderr)
        return 1
    log.info("delayd.ready", queue=args.queue, delay_ms=args.delay_ms, loss=args.loss)
    print("ready", flush=True)
    try:
        serve(sock, args.queue, line)
    except KeyboardInterrupt:
        pass
    finally:
        log.info("delayd.stopped", accepted=line.accepted, dropped=line.dropped, held=len(line))
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
