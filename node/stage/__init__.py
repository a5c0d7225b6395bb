"""A stage node (issue 26): serves passes of hidden states through layers A..B over QUIC (:mod:`.service`), and the
client's link to one (:mod:`.link`); the numerics are :mod:`experts.stage_forward`'s."""
