"""The status page in a real headless browser (Debian's chromium driven by playwright) over a real swarm.

A bootstrap told the model serves the page; two workers host half of every layer's experts each. The page must
list both workers under their layers and expert ranges with their path, and, after one worker stops, drop it
within a few of the page's own reloads (the bootstrap re-looks the DHT up on the same interval).
"""

from __future__ import annotations

import shutil

import pytest

from experts.embedded import EMBEDDED_MODEL
from node.launcher import Cluster
from tests.support import until

pytestmark = pytest.mark.slow
CHROMIUM = shutil.which("chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync"]
LAYERS = range(4)  # the embedded model's
RELOADS = 4  # page reloads allowed for a change to show: a missed host gets one round of grace, and a round may land just after a reload


def hosts_by_cell(page) -> dict[tuple[str, str], set[str]]:
    """(layer, experts) -> peer ids the rendered coverage table lists, read from the DOM."""
    return page.evaluate("""() => Object.fromEntries([...document.querySelectorAll('#coverage tr[data-layer]')].map(
        tr => [tr.dataset.layer + '/' + tr.dataset.experts, [...tr.querySelectorAll('[data-peer]')].map(h => h.dataset.peer + ' ' + h.textContent)]))""")


def test_status_page_lists_both_workers_and_drops_the_one_that_stops(tmp_path):
    playwright = pytest.importorskip("playwright.sync_api", reason="the browser test needs the playwright package (test extra)")
    if CHROMIUM is None:
        pytest.skip("no chromium on PATH (./dev setup installs Debian's chromium as root)")
    model = str(EMBEDDED_MODEL)
    with Cluster(tmp_path / "nodes") as cluster, playwright.sync_playwright() as pw:
        boot = cluster.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--model", model).wait_ready()
        workers = [cluster.start(f"w{i}", "worker", "--model", model, "--experts", experts, "--bootstrap", boot["dht_addrs"][0]) for i, experts in enumerate(("0-15", "16-31"))]
        w0, w1 = (w.wait_ready()["peer_id"] for w in workers)
        browser = pw.chromium.launch_persistent_context(str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            page = browser.new_page()
            page.goto(f"http://{boot['http_addr']}/status")

            def cells() -> dict:
                try:
                    return hosts_by_cell(page)
                except playwright.Error:  # the page was reloading: read it again
                    return {}

            def both_listed() -> dict | None:
                c = cells()
                return c if all(any(w0 in h for h in c.get(f"{layer}/0-15", [])) and any(w1 in h for h in c.get(f"{layer}/16-31", [])) for layer in LAYERS) else None

            listed = until(both_listed, timeout=90, interval=0.5, what="both workers on the status page")
            assert all("direct" in h for hosts in listed.values() for h in hosts)  # loopback workers announce a direct address
            assert "ready" in page.inner_text("#node")
            page.screenshot(path=str(tmp_path / "status-page.png"), full_page=True)

            workers[1].stop()  # SIGTERM: the worker withdraws its records before it exits
            for _ in range(RELOADS):
                page.wait_for_event("load", timeout=60_000)
                if not any(w1 in h for hosts in cells().values() for h in hosts):
                    break
            c = cells()
            assert c and not any(w1 in h for hosts in c.values() for h in hosts), c
            assert all(any(w0 in h for h in c[f"{layer}/0-15"]) and c[f"{layer}/16-31"] == [] for layer in LAYERS)
            assert "lack hosts" in page.inner_text("#node")
            page.screenshot(path=str(tmp_path / "status-page-after.png"), full_page=True)
        finally:
            browser.close()
