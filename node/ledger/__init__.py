"""Paid work: signed receipts, hash-chained ledger entries (pure), the SQLite store and the off-path sink."""
