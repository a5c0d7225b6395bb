"""The QUIC data path: one UDP socket per node, authenticated connections, one request per stream (see endpoint)."""
