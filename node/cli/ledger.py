"""Ledger commands: show totals per peer, verify the chain and signatures, export entries."""

from __future__ import annotations

import sys
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import click

from experts.home import moeswarm_home
from node.cli.root import emit_json
from node.ledger.store import FILENAME, Ledger, LedgerError, Role

ledger_opt = click.option("--ledger", "ledger_path", default=None, type=click.Path(dir_okay=False), help=f"Ledger file (default $MOESWARM_HOME/ROLE/{FILENAME}).")
role_opt = click.option("--role", type=click.Choice([r.value for r in Role]), default=None, help="Without --ledger: whose ledger under $MOESWARM_HOME (default: the one that exists).")


def find_ledger(path: str | None, role: str | None) -> Path:
    """--ledger if given, else the backbone or worker ledger under $MOESWARM_HOME (~/.moeswarm)."""
    if path:
        return Path(path)
    home = moeswarm_home()
    if role:
        return home / role / FILENAME
    found = [home / r / FILENAME for r in Role if (home / r / FILENAME).is_file()]
    if len(found) == 1:
        return found[0]
    if not found:
        raise LedgerError(f"no ledger under {home} (looked in backbone/ and worker/); pass --ledger PATH")
    raise LedgerError(f"both a backbone and a worker ledger exist under {home}; pass --role or --ledger")


def parse_since(ctx: click.Context, param: click.Parameter, text: str | None) -> float | None:
    """Unix seconds, or an ISO-8601 time (UTC when it names no zone)."""
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        pass
    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        raise click.BadParameter(f"{text!r} is neither unix seconds nor an ISO-8601 time (e.g. 2025-01-31T12:00:00Z)") from None
    return (t if t.tzinfo else t.replace(tzinfo=timezone.utc)).timestamp()


@click.group("ledger")
def ledger_group() -> None:
    """The paid-work ledger: receipts of dispatches bought (backbone) or sold (worker)."""


@ledger_group.command("show")
@ledger_opt
@role_opt
@click.option("--peer", default=None, help="Only this peer id.")
@click.option("--since", default=None, callback=parse_since, help="Only receipts recorded at or after this time (unix seconds or ISO-8601).")
@click.option("--json", "as_json", is_flag=True)
def show_cmd(ledger_path: str | None, role: str | None, peer: str | None, since: float | None, as_json: bool) -> None:
    """Dispatches, work units, credits and disputes per peer (the chain is not checked: see `ledger verify`)."""
    path = find_ledger(ledger_path, role)
    with Ledger(path) as ledger:
        totals = ledger.totals(peer=peer, since=since)
        head = {"ledger": str(path), "role": ledger.role.value, "owner": ledger.owner}
    summary = {
        **head,
        "total_dispatches": sum(t.dispatches for t in totals),
        "total_work_units": sum(t.work_units for t in totals),
        "total_credits": sum(t.credits for t in totals),
        "total_disputed": sum(t.disputed for t in totals),
        "peers": [asdict(t) for t in totals],
    }
    if as_json:
        emit_json(summary)
        return
    click.echo(f"{head['role']} ledger {path} of {head['owner']}")
    cols = ("dispatches", "work_units", "credits", "disputed")
    click.echo(f"{'PEER':<54} {'ROLE':<8} " + " ".join(f"{c.upper():>16}" for c in cols))
    for t in summary["peers"]:
        click.echo(f"{t['peer_id']:<54} {t['role']:<8} " + " ".join(f"{t[c]:>16}" for c in cols))
    click.echo(f"{'TOTAL':<54} {'':<8} " + " ".join(f"{summary['total_' + c]:>16}" for c in cols))


@ledger_group.command("verify")
@ledger_opt
@role_opt
def verify_cmd(ledger_path: str | None, role: str | None) -> None:
    """Check the whole hash chain, the signed head and every signature; exit 1 naming the first bad entry."""
    with Ledger(find_ledger(ledger_path, role)) as ledger:
        report = ledger.verify()
    click.echo(str(report))
    if not report.ok:
        sys.exit(1)


@ledger_group.command("export")
@click.option("--format", "fmt", required=True, type=click.Choice(["csv", "jsonl"]))
@ledger_opt
@role_opt
@click.option("-o", "--output", default=None, type=click.Path(dir_okay=False), help="Write here instead of stdout.")
def export_cmd(fmt: str, ledger_path: str | None, role: str | None, output: str | None) -> None:
    """Every stored entry, one row or JSON line each (hashes and signatures in hex)."""
    with Ledger(find_ledger(ledger_path, role)) as ledger:
        if output is None:
            ledger.export(fmt, sys.stdout)
            return
        with open(output, "w", newline="") as out:
            n = ledger.export(fmt, out)
    click.echo(f"exported {n} entries to {output}", err=True)
