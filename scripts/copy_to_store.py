"""Copy a local data root's inputs (runs/, labels.jsonl, retired.json) to a data root on object storage.

    python scripts/copy_to_store.py data s3://training-data/filter

Credentials and endpoint come from the store's standard environment (for S3: AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL for a non-AWS store). The bucket is created if it does not exist.
Outputs (warehouse/) are not copied: the pipeline writes them there itself.
"""

import argparse
from pathlib import Path

import fsspec

INPUTS = ("runs", "labels.jsonl", "retired.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="local data root")
    parser.add_argument("target", help="data root URL, e.g. s3://bucket/prefix")
    args = parser.parse_args()
    fs, root = fsspec.core.url_to_fs(args.target)
    bucket = root.split("/", 1)[0]
    if not fs.exists(bucket):
        fs.mkdir(bucket)
    for name in INPUTS:
        source = args.source / name
        if source.is_dir():
            fs.put(f"{source}/", f"{root}/{name}/", recursive=True)
        elif source.exists():
            fs.put(str(source), f"{root}/{name}")
        else:
            continue
        print(f"copied {source} -> {args.target}/{name}")


if __name__ == "__main__":
    main()
