"""What a backbone session is configured with, as one typed value.

Why a dataclass: the options of ``backbone generate``, ``backbone serve``, the demo, the benches and the tests used to
travel as a ``dict(...)`` spread into ``backbone_session``'s nineteen keywords, where neither mypy nor a reader could
see which keys a caller meant. One frozen value is built once (from click in ``node.cli.options.backbone_options``, or
directly by a test) and passed whole; ``dataclasses.replace`` makes a variant.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from experts.codecs import Codec
from experts.errors import UsageError
from node.backbone.routing import ROUTE_REFRESH_S
from node.backbone.spotcheck import DEFAULT_SPOT_CHECK
from relay.client import RelaySettings


@dataclass(frozen=True)
class BackboneOptions:
    """How a backbone reaches, pays and checks its workers.

    *codec*: the wire format of dispatches (a lossy one only once its gate passed, checked by the session).
    *listen*/*dht_listen*: where its QUIC endpoint and DHT client bind. *timeout*: the most a dispatch waits for a host.
    *max_datagram*: the QUIC datagram size it sends. *spot_check*: the fraction of dispatches re-computed (*spot_seed*
    fixes the sample, for tests). *ledger_path*: where receipts go (None: no ledger). *max_price*: never use workers
    asking more. *local_experts*/*local_memory*: hot experts kept here (a count per layer, or as many as fit the bytes).
    *hold_experts* False: the backbone computes no routed expert itself. *relay*: how links to relays trust and keep
    alive. *route_refresh*: seconds between re-reads of every layer's hosts. *hedge*: a late group is also asked of
    the next replica.
    """

    codec: Codec = Codec.F32
    listen: tuple[str, int] = ("127.0.0.1", 0)
    dht_listen: str = "127.0.0.1:0"
    timeout: float = 5.0
    max_datagram: int = 1200
    spot_check: float = DEFAULT_SPOT_CHECK
    spot_seed: int | None = None
    ledger_path: Path | None = None
    max_price: int | None = None
    local_experts: int = 0
    local_memory: int | None = None
    hold_experts: bool = True
    relay: RelaySettings = field(default_factory=RelaySettings)
    route_refresh: float = ROUTE_REFRESH_S
    hedge: bool = False

    def __post_init__(self) -> None:
        if not self.hold_experts and (self.local_experts or self.local_memory is not None):
            raise UsageError("a backbone that holds no experts keeps no hot experts local either; drop --local-experts/--local-memory or --remote-experts-only")
        if not 0.0 <= self.spot_check <= 1.0:
            raise UsageError(f"the spot-check fraction is between 0 and 1, not {self.spot_check}")
