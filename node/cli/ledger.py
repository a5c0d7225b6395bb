"""Ledger commands: show totals per peer and day, verify the chain and signatures, export, compact, reconcile.

Units: a *work unit* is one floating-point operation of expert compute, counted as 6 x n_embd x n_ff_exp per
(token, expert) a worker computed (three matrix products, a multiply and an add each); a *credit* is a work unit
times the price per work unit the worker announced in its record. Credits are the swarm's bookkeeping unit, not
money: what a credit is worth is agreed between the operators.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import click

from experts.home import moeswarm_home
from node.cli.root import emit_json
from node.ledger.checkpoint import CLOCK_SKEW_US, DISPUTE_WINDOW_S
from node.ledger.reconcile import reconcile
from node.ledger.store import FILENAME, Ledger, LedgerError, Role
from node.ledger.witness import BAD, judge
from p2p.identity import Identity

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


UNITS = "work unit = 1 FLOP of expert compute (6 x n_embd x n_ff_exp per token and expert); credits = work units x the worker's price per unit"
DURATION = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MIN_WINDOW_S = 3600  # a receipt issued up to CLOCK_SKEW after the cutoff is refused: keep the cutoff well in the past


def parse_duration(ctx: click.Context, param: click.Parameter, text: str) -> float:
    """``90s``, ``30m``, ``12h``, ``7d`` (a bare number is seconds)."""
    unit = text[-1:] if text[-1:] in DURATION else "s"
    try:
        value = float(text[:-1] if text[-1:] in DURATION else text) * DURATION[unit]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a duration such as 90s, 30m, 12h or 7d") from None
    if value < MIN_WINDOW_S:
        raise click.BadParameter(f"must be at least 1h: receipts issued up to {CLOCK_SKEW_US // 60_000_000} minutes after the cutoff are refused as replays")
    return value


@click.group("ledger")
def ledger_group() -> None:
    """The paid-work ledger: receipts of dispatches bought (backbone) or sold (worker).

    A work unit is 1 FLOP of expert compute (6 x n_embd x n_ff_exp per token and expert); credits are work units
    times the price per work unit the worker announced.
    """


@ledger_group.command("show")
@ledger_opt
@role_opt
@click.option("--peer", default=None, help="Only this peer id.")
@click.option("--since", default=None, callback=parse_since, help="Only receipts recorded at or after this time (unix seconds or ISO-8601).")
@click.option("--by-day", is_flag=True, help="One row per UTC day and peer.")
@click.option("--json", "as_json", is_flag=True)
def show_cmd(ledger_path: str | None, role: str | None, peer: str | None, since: float | None, by_day: bool, as_json: bool) -> None:
    """Dispatches, work units, credits and disputes per peer (the chain is not checked: see `ledger verify`)."""
    path = find_ledger(ledger_path, role)
    with Ledger(path) as ledger:
        totals = ledger.totals(peer=peer, since=since)
        days = ledger.day_totals(peer=peer, since=since)
        checkpoint = ledger.checkpoint()
        head = {"ledger": str(path), "role": ledger.role.value, "owner": ledger.owner}
    cols = ("dispatches", "work_units", "credits", "disputed")
    summary = {
        **head,
        "units": UNITS,
        "archived_through": checkpoint.through_seq if checkpoint else 0,
        **{f"total_{c}": sum(getattr(t, c) for t in totals) for c in cols},
        "peers": [asdict(t) for t in totals],
        "days": [asdict(t) for t in days],
    }
    if as_json:
        emit_json(summary)
        return
    click.echo(f"{head['role']} ledger {path} of {head['owner']}")
    click.echo(f"({UNITS})")
    lead = (lambda day: f"{day:<11}") if by_day else (lambda day: "")
    click.echo(lead("DAY") + f"{'PEER':<54} " + " ".join(f"{c.upper():>16}" for c in cols))
    for t in summary["days"] if by_day else summary["peers"]:
        click.echo(lead(t.get("day", "")) + f"{t['peer_id']:<54} " + " ".join(f"{t[c]:>16}" for c in cols))
    click.echo(lead("") + f"{'TOTAL':<54} " + " ".join(f"{summary['total_' + c]:>16}" for c in cols))


@ledger_group.command("verify")
@ledger_opt
@role_opt
def verify_cmd(ledger_path: str | None, role: str | None) -> None:
    """Check the whole hash chain, the signed head and every signature, and the chain's end against the head record
    beside the file (LEDGER.head, fsynced at every commit); exit 1 naming the first bad entry, or how many
    acknowledged entries are missing (a damaged or lost WAL, a file restored from an older copy)."""
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


@ledger_group.command("compact")
@ledger_opt
@role_opt
@click.option("--key", "key_path", default=None, type=click.Path(dir_okay=False, exists=True), help="The ledger owner's key (default key.pem beside the ledger).")
@click.option("--older-than", "window_s", default=f"{DISPUTE_WINDOW_S // 86400}d", show_default=True, callback=parse_duration,
              help="Archive receipts paid, disputed, or unchanged for this long (e.g. 12h, 7d).")  # fmt: skip
@click.option("--archive-dir", default=None, type=click.Path(file_okay=False), help="Where archive files go (default archive/ beside the ledger).")
@click.option("--json", "as_json", is_flag=True)
def compact_cmd(ledger_path: str | None, role: str | None, key_path: str | None, window_s: float, archive_dir: str | None, as_json: bool) -> None:
    """Move settled entries to a gzipped archive, leaving a checkpoint signed by the owner; `verify` still checks the rest."""
    path = find_ledger(ledger_path, role)
    key = Path(key_path) if key_path else path.parent / "key.pem"
    if not key.is_file():
        raise LedgerError(f"compaction re-signs the ledger with its owner's key, and {key} does not exist; pass --key")
    with Ledger(path, identity=Identity.load_or_create(key)) as ledger:
        report = ledger.compact(window_s=window_s, archive_dir=Path(archive_dir) if archive_dir else None)
    if as_json:
        emit_json({**asdict(report), "archive": str(report.archive) if report.archive else None})
    elif report.archived:
        click.echo(f"archived {report.archived} entries to {report.archive} (entries 1-{report.through_seq} now under a signed checkpoint);"
                   f" kept {report.kept}; {report.bytes_before} -> {report.bytes_after} bytes")  # fmt: skip
    else:
        click.echo(f"nothing to archive: every entry after {report.through_seq} belongs to a dispatch still open or changed within the window; kept {report.kept}")


@ledger_group.command("reconcile")
@click.argument("first", type=click.Path(dir_okay=False))
@click.argument("second", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True)
def reconcile_cmd(first: str, second: str, as_json: bool) -> None:
    """Compare a backbone's ledger with a worker's: receipts missing on either side or differing, and each side's
    signed head of the other against the other's chain (a rollback to an older copy shows); exit 1 if anything is off."""
    receipts, owners, ledgers, cutoff = {}, {}, {}, 0
    with contextlib.ExitStack() as stack:
        for p in (first, second):
            ledger = stack.enter_context(Ledger(p))
            if ledger.role in ledgers:
                raise LedgerError(f"both ledgers are {ledger.role} ledgers; reconcile compares a backbone's with a worker's")
            ledgers[ledger.role], owners[ledger.role] = ledger, ledger.owner
            receipts[ledger.role] = [e.event.receipt for e in ledger.entries() if e.event.receipt is not None]
            checkpoint = ledger.checkpoint()
            cutoff = max(cutoff, checkpoint.cutoff_us + CLOCK_SKEW_US if checkpoint else 0)
        rollbacks = []
        for holder, other in ((Role.BACKBONE, Role.WORKER), (Role.WORKER, Role.BACKBONE)):
            held = ledgers[holder].witnessed(owners[other])
            if held is not None:
                now = ledgers[other].head()
                verdict = judge(held, now, ledgers[other].hash_at(held.seq))
                if verdict in BAD:
                    rollbacks.append(f"the {other} ledger {verdict.value.replace('_', ' ')}: it signed entry {held.seq} (held by the {holder}), it now ends at {now.seq}")
            rollbacks += [f"the {holder} recorded the {other} {v.replace('_', ' ')}: head {a.seq} held, head {b.seq} shown" for a, b, v in ledgers[holder].conflicts()]
    result = reconcile(owners[Role.BACKBONE], owners[Role.WORKER], receipts[Role.BACKBONE], receipts[Role.WORKER], after_us=cutoff)
    ok = result.ok and not rollbacks
    if as_json:
        emit_json({**asdict(result), "rollbacks": rollbacks, "ok": ok})
    else:
        click.echo(f"{result.compared} dispatches from backbone {result.backbone} to worker {result.worker}")
        for did in result.missing_at_worker:
            click.echo(f"missing in the worker's ledger: {did} (the backbone holds it signed by the worker)")
        for did in result.missing_at_backbone:
            click.echo(f"missing in the backbone's ledger: {did}")
        for d in result.differing:
            click.echo(f"differs: {d.dispatch_id} ({', '.join(d.fields)})")
        for line in rollbacks:
            click.echo(f"rollback: {line}")
        click.echo("ok: both ledgers hold the same receipts" if ok else "MISMATCH")
    if not ok:
        sys.exit(1)
