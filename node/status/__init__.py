"""What a long-running node shows about itself over HTTP: health, readiness, Prometheus metrics and a status page.

:mod:`node.status.coverage` (the swarm's hosts per layer and expert range, and readiness) and
:mod:`node.status.page` (the HTML) are pure; :mod:`node.status.metrics` reads the nodes' own statistics at scrape
time; :mod:`node.status.server` is the thin aiohttp edge that the CLI starts with ``--http HOST:PORT``.
"""
