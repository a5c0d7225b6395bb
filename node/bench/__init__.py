"""Benchmarks: each module measures one thing and returns a result dict; `node.cli.bench` publishes it."""
