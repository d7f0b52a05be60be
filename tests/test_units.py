"""Sizes and bandwidths written by people (``gds_offload.units``)."""
from __future__ import annotations

import pytest

from gds_offload.errors import ConfigError
from gds_offload.units import format_bytes, parse_bandwidth, parse_bytes


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("40GiB", 40 << 30),
        ("40 GiB", 40 << 30),
        (" 512MB ", 512 * 10**6),
        ("1.5 GB", 1_500_000_000),
        ("4096", 4096),
        ("64kib", 64 << 10),
        ("2TiB", 2 << 40),
        ("1e3", 1000),
        ("0", 0),
        (4096, 4096),
        (1.5e3, 1500),
    ],
)
def test_parse_bytes(text: str | int | float, nbytes: int) -> None:
    assert parse_bytes(text) == nbytes


def test_parse_bytes_unknown_unit_is_a_helpful_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        parse_bytes("40 gigs", name="reserve")
    msg = str(info.value)
    assert "reserve='40 gigs' is not a size" in msg
    assert "GiB" in msg and "'40GiB'" in msg, "the message shows the accepted units and an example"


@pytest.mark.parametrize("bad", [-1, -0.5, "-5MiB", "GiB", "", "1.2.3MB", "5 MiB/s"])
def test_parse_bytes_rejects(bad: object) -> None:
    with pytest.raises(ConfigError, match="size"):
        parse_bytes(bad)  # type: ignore[arg-type]


def test_parse_bytes_rejects_negative_numbers_by_name() -> None:
    with pytest.raises(ConfigError, match=r"min_bytes=-1 is negative; pass a byte count >= 0"):
        parse_bytes(-1, name="min_bytes")


@pytest.mark.parametrize("bad", [True, None, [1], object()])
def test_parse_bytes_rejects_non_sizes(bad: object) -> None:
    with pytest.raises(ConfigError):
        parse_bytes(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "rate"),
    [("200MB/s", 200e6), ("1.5GiB/s", 1.5 * 2**30), ("128 MB/s", 128e6), ("10MBps", 10e6), (5e8, 5e8), ("1GB", 1e9)],
)
def test_parse_bandwidth(text: str | float, rate: float) -> None:
    assert parse_bandwidth(text) == rate


@pytest.mark.parametrize("bad", [0, "0MB/s", -1, "-3GB/s", "fast", "40 gigs/s"])
def test_parse_bandwidth_rejects(bad: object) -> None:
    with pytest.raises(ConfigError, match="max_bandwidth="):
        parse_bandwidth(bad)  # type: ignore[arg-type]


def test_format_bytes() -> None:
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(64 << 20) == "64 MiB"
    assert format_bytes(40 << 30) == "40 GiB"
    assert format_bytes(3 << 40) == "3 TiB"
    assert parse_bytes(format_bytes(64 << 20).replace(" ", "")) == 64 << 20


def test_format_bytes_of_a_figure_not_measured() -> None:
    """The one byte formatter serves tables too: a figure not measured (``None``) shows as ``missing``."""
    assert format_bytes(None) == "-"
    assert format_bytes(None, missing="unknown") == "unknown"
    assert format_bytes(0, missing="unknown") == "0 B"
