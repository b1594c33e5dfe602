"""errors.one_line: another library's message, on one line and bounded, for ours."""

from edgespec.errors import one_line


def test_one_line_joins_whitespace_and_cuts_with_an_ellipsis():
    assert one_line(ValueError("bad\n  value\tthere")) == "bad value there"
    long = one_line("x " * 300)
    assert len(long) == 200 and long.endswith("...")
    assert one_line("x " * 300, limit=None) == " ".join(["x"] * 300)
