"""The storage room: how the stage writes to the data root safely (locks, leases, commit records, atomic and
conditional writes, appends to shared files such as labels.jsonl), on local disk and on object storage."""
