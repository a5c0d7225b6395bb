"""The status page: ``/status.json``'s content as one server-rendered HTML page that reloads itself.

No framework and no script: a ``<meta http-equiv="refresh">`` reloads it every ``refresh_s`` seconds, so what it
shows is never older than one refresh plus one DHT lookup round. Every value is escaped.
"""

from __future__ import annotations

from html import escape

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em;margin:0 0 .3em} h2{font-size:1.05em;margin:1.4em 0 .4em}
table{border-collapse:collapse} td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left;vertical-align:top}
th{background:#f3f3f3} .ok{color:#1a7f37} .bad{color:#b42318} .gap{background:#fde8e8} .muted{color:#777}
code{font-size:.95em}
"""


def _e(value: object) -> str:
    return escape(str(value), quote=True)


def _hosts(hosts: list[dict]) -> str:
    if not hosts:
        return '<span class="bad">no host</span>'
    items = []
    for h in hosts:
        seen = h.get("seen")
        used = f" · used {_e(seen['path'])}" + (f" · {seen['rtt_ms']:.1f} ms" if seen.get("rtt_ms") is not None else "") if seen else ""
        items.append(f'<div class="host" data-peer="{_e(h["peer"])}"><code>…{_e(h["peer"][-8:])}</code> {_e(h["announced"])}{_e(used)}'
                     f'{" · " + _e(h["addr"]) if h.get("addr") else ""}{" · price " + _e(h["price"]) if h.get("price") else ""}</div>')
    return "".join(items)


def render(status: dict, refresh_s: float) -> str:
    """The page for one ``/status.json`` body."""
    ready = status["ready"]
    state = '<span class="ok">ready</span>' if ready is True else f'<span class="bad">not ready: {_e(ready)}</span>'
    rows = [f"<tr><th>role</th><td>{_e(status['role'])}</td></tr>", f"<tr><th>peer id</th><td><code>{_e(status['peer_id'])}</code></td></tr>", f"<tr><th>state</th><td>{state}</td></tr>"]
    for key, label in (("addresses", "addresses"), ("slices", "hosts"), ("earnings", "ledger")):
        if status.get(key):
            rows.append(f"<tr><th>{label}</th><td>{_e(status[key])}</td></tr>")
    parts = [f"<h1>moeswarm {_e(status['role'])}</h1>", f"<table id=node>{''.join(rows)}</table>"]
    cov = status.get("coverage")
    if cov is None:
        parts.append('<h2>Coverage</h2><p class="muted">no model to look up (start this node with --model to see the swarm\'s hosts)</p>' if not status.get("looking_up") else '<h2>Coverage</h2><p class="muted">first DHT lookup in progress…</p>')
    else:
        body = "".join(
            f'<tr class="{"gap" if not c["hosts"] else "cell"}" data-layer="{c["layer"]}" data-experts="{c["start"]}-{c["stop"] - 1}">'
            f'<td>{c["layer"]}</td><td>{c["start"]}–{c["stop"] - 1}</td><td>{len(c["hosts"])}</td><td>{_hosts(c["hosts"])}</td></tr>'
            for c in cov["cells"]
        )
        parts.append(f'<h2>Coverage of model <code>{_e(cov["model"][:12])}</code> ({cov["n_layer"]} layers × {cov["n_expert"]} experts)</h2>'
                     f'<table id=coverage><tr><th>layer</th><th>experts</th><th>hosts</th><th>who · path · RTT</th></tr>{body}</table>')
    errors = status.get("recent_errors") or []
    parts.append("<h2>Recent errors</h2>" + ("<ul id=errors>" + "".join(f"<li><code>{_e(e['at'])}</code> {_e(e['level'])} {_e(e['event'])} {_e(e.get('detail', ''))}</li>" for e in errors) + "</ul>" if errors else '<p class="muted">none</p>'))
    parts.append(f'<p class="muted">refreshes every {refresh_s:g} s · <a href="/status.json">status.json</a> · <a href="/metrics">metrics</a></p>')
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><meta http-equiv="refresh" content="{refresh_s:g}">'
            f"<title>moeswarm {_e(status['role'])}</title><style>{STYLE}</style></head><body>{''.join(parts)}</body></html>")
