"""One error hierarchy: every exception class moeswarm defines derives from experts.errors.MoeSwarmError."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import experts
import node
import p2p
import relay
from experts.errors import LocalProtocolError, MoeSwarmError, RemoteProtocolError, UsageError


def _defined_exceptions() -> list[type[BaseException]]:
    found = []
    for package in (experts, node, p2p, relay):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if info.name.endswith(".__main__"):  # runs the CLI
                continue
            module = importlib.import_module(info.name)
            for _, obj in inspect.getmembers(module, inspect.isclass):
                if issubclass(obj, BaseException) and obj.__module__ == module.__name__:
                    found.append(obj)
    return found


def test_every_exception_has_the_one_root():
    """No module defines an exception outside MoeSwarmError (so ``except MoeSwarmError`` means "ours")."""
    found = _defined_exceptions()
    assert len(found) > 40
    assert [f"{e.__module__}.{e.__qualname__}" for e in found if not issubclass(e, MoeSwarmError)] == []


def test_peer_bytes_are_remote_and_misuse_is_local():
    """Errors about bytes a peer sent are RemoteProtocolErrors; this side's misuse is a LocalProtocolError."""
    from node.backbone.batching import BatchingError
    from node.ledger.receipts import ReceiptError
    from p2p.dht import records
    from p2p.identity import IdentityError, KeyFileError
    from p2p.nat import envelope as natwire
    from p2p.nat.paths import InvalidTransition
    from p2p.quic import tls
    from p2p.wire import messages as wire
    from relay import protocol

    for remote in (wire.ProtocolError, natwire.FrameError, records.RecordError, protocol.FrameError, tls.PeerCertificateError, ReceiptError, IdentityError):
        assert issubclass(remote, RemoteProtocolError), remote
    for local in (protocol.LocalProtocolError, InvalidTransition, BatchingError):
        assert issubclass(local, LocalProtocolError) and not issubclass(local, RemoteProtocolError), local
    assert issubclass(KeyFileError, UsageError)
