"""Arrow's whole-file read and the line-by-line record checks agree (`rules/batch.py`): on seeded random
files of odd records (escapes, every scalar type in a key, integers beyond 64 bits and beyond Python's
limit, numbers only Arrow reads, fields written twice, nesting, lines over the length limit, two objects on
a line, an object over two lines, blank lines, a line that is no object, a bare `\r`), wherever Arrow
vouches for a file its rows are the record checks' rows, and the checks reject nothing. The line limit is
low here, and with it the size of Arrow's blocks: many lines start a block."""

import json
import random

import pandas as pd
import pytest

from filter_pipeline.rules import batch as batch_module
from filter_pipeline.rules import records
from filter_pipeline.rules.schemas import conform

LONG = "1" + "0" * 5000  # beyond Python's int-string limit
TEXTS = ["a", "", "é", "\U0001f600", 'x"y', "tab\there", "1" * 20, "null", "\u2028", "/", "\x7f", "\x01"]
RAW_TEXTS = ['"\\u00e9"', '"\\/"', '"\\ud800"', '"\\ud83d\\ude00"', '"\\x"', '"7' + "7" * 5000 + '"']
SCALARS = [0, 1, -1, 2**63 - 1, 2**63, -(2**63), 10**18, 1.0, -0.0, 1e16, 1.5e-7, 1e308, True, False, None]


def text(rng: random.Random) -> str:
    if rng.random() < 0.15:
        return rng.choice(RAW_TEXTS)
    return json.dumps(rng.choice(TEXTS), ensure_ascii=rng.random() < 0.5)


def scalar(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.08:
        return rng.choice([LONG, "NaN", "Infinity", "-Infinity", "Inf", "-Inf", "-NaN"])
    return text(rng) if r < 0.5 else json.dumps(rng.choice(SCALARS))


def value(rng: random.Random, depth: int = 0) -> str:
    r = rng.random()
    if r < 0.5 or depth > 2:
        return scalar(rng)
    if r < 0.75:
        return "[" + ",".join(value(rng, depth + 1) for _ in range(rng.randint(0, 3))) + "]"
    return "{" + ",".join(f'"k{i}":{value(rng, depth + 1)}' for i in range(rng.randint(0, 3))) + "}"


def usually(rng: random.Random, good: str, p: float = 0.92) -> str:
    return good if rng.random() < p else value(rng)


def line(rng: random.Random, fields: dict[str, str]) -> str:
    """One JSON object line of `fields` (raw JSON texts) in random order, maybe an extra field or one written
    twice."""
    items = list(fields.items())
    if rng.random() < 0.3:
        items.append(("extra", value(rng)))
    if rng.random() < 0.04:
        items.append(rng.choice(items))
    rng.shuffle(items)
    return "{" + rng.choice([",", ", ", " ,\t"]).join(f'"{k}":{v}' for k, v in items) + "}"


def task_line(rng: random.Random, i: int) -> str:
    key = "[" + ",".join(scalar(rng) for _ in range(rng.randint(0, 4))) + "]"
    start = '{"kind":' + usually(rng, text(rng)) + (',"url":' + value(rng) if rng.random() < 0.3 else "") + "}"
    return line(rng, {"task_id": usually(rng, f'"t{i}"'), "macro": text(rng), "site": text(rng),
                      "instruction": text(rng), "dedup_key": usually(rng, key), "start": usually(rng, start)})  # fmt: skip


def attempt_line(rng: random.Random, i: int) -> str:
    steps = "[" + ",".join(usually(rng, '{"action":' + value(rng) + "}") for _ in range(rng.randint(0, 3))) + "]"
    backend = rng.choice(["null", '{"ok":true,"detail":"d"}', '{"ok":false,"detail":' + value(rng) + "}",
                          '{"ok":' + value(rng) + "}", '{"ok":true,"n":' + value(rng) + "}"])  # fmt: skip
    fields = {"task_id": usually(rng, f'"t{i}"'), "attempt": usually(rng, str(rng.randint(1, 3))),
              "ok": usually(rng, rng.choice(["true", "false"])), "dir": usually(rng, f'"runs/r/{i}"'),
              "steps": usually(rng, steps), "backend": backend}  # fmt: skip
    if rng.random() < 0.5:
        fields["error"] = usually(rng, '"e"', 0.7)
    return line(rng, fields)


LIMIT = 400  # the line length limit in these files (records.MAX_LINE_BYTES, patched): some lines go over it


def random_file(rng: random.Random, make_line) -> bytes:
    lines = [make_line(rng, i) for i in range(rng.randint(1, 4))]
    r = rng.random()
    if r < 0.05:  # anywhere: Arrow starts each of its blocks as it starts the file
        odd = rng.choice(["null", " null", "[]", "1", '"x"', "\ufeff" + lines[0]])
        lines.insert(rng.randint(0, len(lines)), odd)
    elif r < 0.1:
        lines[0] = lines[0] + rng.choice(["", " ", "\t"]) + lines[-1]  # two objects on one line
    elif r < 0.15:
        cut = lines[0].index(",") + 1 if "," in lines[0] else 1
        lines[0:1] = [lines[0][:cut], lines[0][cut:]]  # an object over two lines
    if rng.random() < 0.1:
        lines.insert(rng.randint(0, len(lines)), rng.choice(["", " ", "\r"]))
    if rng.random() < 0.05:  # Arrow also starts a block after a `\r`, which json reads as a space
        at = rng.randrange(len(lines))
        lines[at] += "\r" + rng.choice(["null", "\ufeff" + lines[0], " " + lines[-1], ""])
    return ("\n".join(lines) + ("\n" if rng.random() < 0.8 else "")).encode("utf-8", "surrogatepass")


@pytest.mark.parametrize(
    "make_line, arrow_read, to_row, fields, columns, asset",
    [
        (task_line, batch_module._arrow_tasks, records.task_row, records.TASK_LINE, records.TASK_FIELDS,
         "batch_tasks"),
        (attempt_line, batch_module._arrow_attempts, records.attempt_row, records.ATTEMPT_LINE,
         records.ATTEMPT_FIELDS, "batch_attempts"),
    ],
    ids=["tasks", "attempts"],
)  # fmt: skip
def test_where_arrow_vouches_for_a_file_the_record_checks_read_the_same_rows(
    monkeypatch, make_line, arrow_read, to_row, fields, columns, asset
):
    monkeypatch.setattr(records, "MAX_LINE_BYTES", LIMIT)
    monkeypatch.setattr(batch_module, "MAX_LINE_BYTES", LIMIT)
    rng = random.Random(20261204)
    vouched = 0
    for _ in range(2000):
        data = random_file(rng, make_line)
        fast = arrow_read(data)
        if fast is None:
            continue
        vouched += 1
        rows, rejects = batch_module._read_lines(data, "file", to_row, fields, batch_module._deep_attempt_row)
        assert rejects == [], data
        slow = batch_module._frame(rows, columns, asset)
        # as the outputs hold them: the asset's types (an int is no float or bool there)
        pd.testing.assert_frame_equal(conform(fast, asset), conform(slow, asset), obj=repr(data))
    assert vouched > 50  # (Arrow takes a fair share of the files, not a handful)
