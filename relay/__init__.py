"""The WebSocket packet relay for peers that cannot reach each other directly (see relay.protocol for the wire).

Modules: ``protocol`` (frames) and ``session`` (state machines) are sans-IO; ``server`` and ``client`` are the asyncio
edges (websockets). Nothing is re-exported here, so importing the sans-IO modules does not pull in the edges.
"""
