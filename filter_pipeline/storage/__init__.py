"""The storage room: the one place that touches the data root's files for the ledger. It holds the lease (one walk
at a time per data root), atomic writes, commit records written conditionally, and the staged publish of a walk's
files (nothing a walk writes is visible in the folders users read until its commit record stands); local disk and
object storage are told apart here, once."""
