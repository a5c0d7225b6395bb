"""How a request reaches a peer, in one name: ``Path.DIRECT`` (its UDP address) or ``Path.RELAY`` (a relay carries it).

The router decides it from a host's record, the endpoint's connection addresses imply it (a relayed peer's
address is the virtual ``("relay:<peer id>", 0)``), dispatch statistics count by it and receipts sign it. The
values are strings, so receipts' canonical JSON, the ledger and the logs keep the text "direct" / "relay".
"""

from __future__ import annotations

from enum import StrEnum

RELAY_HOST_PREFIX = "relay:"  # the host part of a relayed peer's virtual address: never an IP literal


class Path(StrEnum):
    DIRECT = "direct"
    RELAY = "relay"

    @classmethod
    def of_address(cls, addr: tuple[str, int] | None) -> Path:
        """The path a connection address stands for (no connection: RELAY, the path every peer starts on)."""
        return cls.RELAY if addr is None or str(addr[0]).startswith(RELAY_HOST_PREFIX) else cls.DIRECT

    @property
    def other(self) -> Path:
        return Path.RELAY if self is Path.DIRECT else Path.DIRECT
