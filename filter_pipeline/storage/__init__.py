"""The storage room: the one place that touches the data root's files. It holds the lease (one walk at a time per
data root), atomic writes, commit records written conditionally, the staged publish of a walk's files (nothing a walk
writes is visible in the folders users read until its commit record stands) and the appends to shared files such as
labels.jsonl; local disk and object storage are told apart here, once."""
