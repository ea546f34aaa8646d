"""A line reads the same whichever JSON reader takes it: orjson reads first, json decides what orjson refuses,
and the canonical dedup_key text is json.dumps's, byte for byte."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from filter_pipeline.rules import records
from filter_pipeline.rules.schemas import key_hash

# what a dedup_key may hold: scalars, with the floats and integers where JSON readers differ
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=2**63 - 3, max_value=2**64 + 3),
    st.integers(min_value=-(2**63) - 3, max_value=-(2**63) + 3),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([1e16, -0.0, 0.0, 1e-7, 5e-324, 1.7976931348623157e308, 123456789012345680.0]),
    st.text(),
)
_LONE_SURROGATES = st.sampled_from(["\ud800", "\udfff", "a\udc00b"])
_VALUES = st.recursive(
    st.one_of(_SCALARS, st.floats(), _LONE_SURROGATES),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12,
)


def _outcome(read, raw: bytes) -> str:
    """What reading `raw` gives, as text to compare: the value's repr (which tells 1 from 1.0 and -0.0 from
    0.0, and keeps key order) or the reject's field and message."""
    try:
        return "value " + repr(read(raw))
    except records.Reject as rej:
        return f"reject {rej.field!r} {rej.message}"


@settings(max_examples=400, deadline=None)
@given(key=st.lists(_SCALARS, max_size=6), ascii_only=st.booleans())
def test_canonical_key_text_is_json_dumps_for_any_scalar_list(key, ascii_only):
    line = json.dumps(
        {"task_id": "t1", "macro": "m", "site": "s", "instruction": "i", "dedup_key": key, "start": {"kind": "url"}},
        ensure_ascii=ascii_only,
    ).encode()
    row = records.task_row(records.load_record(line))
    expected = json.dumps(key, ensure_ascii=False, separators=(",", ":"))
    assert row[records.TASK_FIELDS.index("dedup_key")] == expected
    assert row[records.TASK_FIELDS.index("key_hash")] == key_hash(expected)


@settings(max_examples=400, deadline=None)
@given(record=st.dictionaries(st.text(max_size=4), _VALUES, max_size=5), ascii_only=st.booleans())
def test_a_line_reads_as_json_alone_reads_it(record, ascii_only):
    line = json.dumps(record, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    assert _outcome(records.load_record, line) == _outcome(records._load_checked, line)


_NUMBER = st.from_regex(r"\A-?(0|[1-9][0-9]{0,24})(\.[0-9]{1,20})?([eE][+-]?[0-9]{1,3})?\Z")


@settings(max_examples=400, deadline=None)
@given(number=_NUMBER, nested=st.booleans())
def test_any_number_literal_reads_as_json_reads_it(number, nested):
    line = (f'{{"n":[{number}]}}' if nested else f'{{"n":{number}}}').encode()
    assert _outcome(records.load_record, line) == _outcome(records._load_checked, line)


def test_lines_orjson_refuses_are_judged_by_json():
    for line in [b'{"k":NaN}', b'{"k":1e400}', b'{"k":"\\ud800"}', b'{"k":18446744073709551616}', b"[1]", b"{bad"]:
        assert _outcome(records.load_record, line) == _outcome(records._load_checked, line)
    assert records.load_record(b'{"k":18446744073709551616}') == {"k": 18446744073709551616}


@settings(max_examples=400, deadline=None)
@given(key=st.lists(_SCALARS | st.integers(min_value=2**64), max_size=6))
def test_key_text_is_json_dumps_whichever_writer_writes_it(key):
    expected = json.dumps(key, ensure_ascii=False, separators=(",", ":"))
    assert records.key_text(key) == expected
    assert records.clean_key(key) == expected
