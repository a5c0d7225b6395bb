"""NAT traversal: reachability on the QUIC socket, UDP hole punching through the relay, the path kept per peer."""
