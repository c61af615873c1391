"""Memory sizes as people write them (--kv-cache-memory)."""
from __future__ import annotations

import pytest

from batchprompt.units import format_bytes, parse_memory

GiB, MiB = 1 << 30, 1 << 20


@pytest.mark.parametrize("text, expected", [
    ("4GiB", (4 * GiB, None)), ("4gib", (4 * GiB, None)), ("4 GiB", (4 * GiB, None)), ("4Gi", (4 * GiB, None)),
    ("1.5G", (int(1.5 * GiB), None)), ("64MiB", (64 * MiB, None)), ("512M", (512 * MiB, None)),
    ("512MB", (512 * 10**6, None)), ("2GB", (2 * 10**9, None)), ("0.5GiB", (GiB // 2, None)),
    ("100K", (102400, None)), ("1T", (1 << 40, None)), ("4096B", (4096, None)),
    ("4294967296", (4294967296, None)), ("2", (2, None)),  # plain bytes, as the option took before
    ("0.3", (None, 0.3)), (".25", (None, 0.25)), ("30%", (None, 0.3)), ("12.5 %", (None, 0.125)),
    (" 1 ", (None, 1.0)),  # a plain 1 is the whole of free memory, not one byte
])
def test_good_sizes(text, expected):
    assert parse_memory(text) == expected


@pytest.mark.parametrize("text, message", [
    ("", "is not a memory size"), ("abc", "is not a memory size"), ("-1G", "is not a memory size"),
    ("1e9", "is not a memory size"), ("0.3.4", "is not a memory size"), ("%", "is not a memory size"),
    ("4 gigs", "unknown unit 'gigs'"), ("3 GiBs", "unknown unit"),
    ("1.5", "plain bytes are a whole number"),
    ("0", "must be above 0"), ("0%", "must be above 0"), ("96%", "at most 95%"), ("1", "at most 95%"),
    ("0GiB", "less than one byte"),
])
def test_bad_sizes_name_the_input_and_the_forms(text, message):
    with pytest.raises(ValueError) as e:
        parse_memory(text, max_fraction=0.95)
    assert message in str(e.value) and repr(text) in str(e.value)


def test_an_unreadable_size_lists_every_form():
    with pytest.raises(ValueError, match=r"4GiB, 512MB, 1\.5G.*plain bytes.*0\.3 or 30%"):
        parse_memory("lots")


def test_format_bytes():
    assert [format_bytes(n) for n in (512, 1024, 64 * MiB, 3 * GiB // 2, 5 << 40)] == \
        ["512 B", "1 KiB", "64 MiB", "1.5 GiB", "5 TiB"]
