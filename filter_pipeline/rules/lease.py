"""STUB of helper C1's lease on the data root (branch `ledger-integrity` replaces this file)."""


class LedgerBusy(Exception):
    """Raised at once when another walker holds the data root's lease."""
