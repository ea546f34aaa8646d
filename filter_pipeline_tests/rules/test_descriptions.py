"""The texts shown beside outputs, and the one-line form of any message."""

from filter_pipeline.rules.descriptions import one_line


def test_one_line_makes_every_whitespace_run_one_space_and_cuts_to_the_limit():
    assert one_line("a\n  b\tc \r\n") == "a b c"
    assert one_line(ValueError("first line\nsecond line"), max_chars=10) == "first line"
    assert one_line("") == ""
