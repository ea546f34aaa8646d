"""Canonical key texts and their hashes, in bulk and one by one."""

import json

import pyarrow as pa

from filter_pipeline.schemas import canonical_key, canonical_texts, key_hash, key_hashes

# Key texts as a generator may write them: some already canonical, some that only parse to a canonical text.
RAW_KEYS = [
    '["s","#a",1]', '["s","#a",0]', '["s","#a",-12]', "[]", '["sité","#a",true,false,null]',
    '["s","#a","\\n\\t\\"\\\\ \\b\\f\\r"]', '["s","#a",12345678901234567890]',  # canonical as written
    '["s","#a",-0]', '["s","#a",1E5]', '["s","#a",1.50]', '["s","#a","\\/x"]', '["s","#a","\\u00e9"]',
    '["s","#a","\\u0001"]', '["s","#a","\\u001F"]', '[ "s" ,"#a",1]', '["s","#a",1.0]',  # not canonical as written
]  # fmt: skip


def test_canonical_texts_equal_canonical_key_of_each_parsed_key():
    assert canonical_texts(pa.array(RAW_KEYS)) == [canonical_key(json.loads(raw)) for raw in RAW_KEYS]


def test_texts_already_canonical_are_the_ones_json_dumps_writes_unchanged():
    for raw in RAW_KEYS:
        [text] = canonical_texts(pa.array([raw]))
        assert text == json.dumps(json.loads(raw), ensure_ascii=False, separators=(",", ":"))


def test_key_hashes_equal_key_hash_one_by_one():
    texts = [canonical_key(json.loads(raw)) for raw in RAW_KEYS]
    assert key_hashes(texts).tolist() == [key_hash(t) for t in texts]
    assert key_hashes([]).tolist() == []
