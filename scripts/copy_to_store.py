"""Copy a local data root's inputs (runs/, labels.jsonl, retired.json) to a data root on object storage.

    python scripts/copy_to_store.py data s3://training-data/filter

Credentials and endpoint come from the store's standard environment (for S3: AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL for a non-AWS store). The bucket is created if it does not exist.
Outputs (warehouse/) are not copied: the pipeline writes them there itself.
"""

import argparse
import sys
from pathlib import Path

import fsspec

INPUTS = ("runs", "labels.jsonl", "retired.json")


def main() -> int:
    """0 copied; 2 bad input or a store that refused (one line on stderr, no traceback)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="local data root")
    parser.add_argument("target", help="data root URL, e.g. s3://bucket/prefix")
    args = parser.parse_args()
    if not args.source.is_dir():
        return _refuse(f"{args.source}: no such folder (give the local data root, the folder that holds runs/)")
    try:
        copy(args.source, args.target)
    except Exception as exc:  # noqa: BLE001 - the store's client raises many kinds; each is told in one line
        message = " ".join(str(exc).split()) or type(exc).__name__
        return _refuse(f"{args.target}: {message}")
    return 0


def _refuse(line: str) -> int:
    print(f"copy_to_store: {line}", file=sys.stderr)
    return 2


def copy(source_root: Path, target: str) -> None:
    """Copy each input of `source_root` that exists to `target`, creating the bucket if needed."""
    fs, root = fsspec.core.url_to_fs(target)
    bucket = root.split("/", 1)[0]
    if not bucket:
        raise ValueError("no bucket named: give the data root as s3://bucket/prefix")
    if not fs.exists(bucket):
        fs.mkdir(bucket)
    for name in INPUTS:
        source = source_root / name
        if source.is_dir():
            fs.put(f"{source}/", f"{root}/{name}/", recursive=True)
        elif source.exists():
            fs.put(str(source), f"{root}/{name}")
        else:
            continue
        print(f"copied {source} -> {target}/{name}")


if __name__ == "__main__":
    sys.exit(main())
