"""The storage room: the data root's layout and the writes that must be safe there. It lists and reads batches and
history, holds the lease (one walk at a time per data root), writes files atomically and commit records conditionally,
stages and publishes a walk's files (nothing a walk writes is visible in the folders users read until its commit record
stands) and appends to shared files such as labels.jsonl; whether a path is local or on an object store is decided
here, once. The IO manager, the judge's progress store and the review app read and write through its helpers."""
