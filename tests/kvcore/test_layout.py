from __future__ import annotations

import pytest

from kvcore import KVCacheLayout, KVCacheLayoutError

# The reference table: value, layer_view_order, then the four predicates
# (layer_compact, block_contiguous, block_compact, block_outermost).
REFERENCE = {
    "LBHNC": ((0, 1, 2, 3, 4), (0, 1, 2, 3), (True, True, True, False)),
    "LBNHC": ((0, 1, 3, 2, 4), (0, 2, 1, 3), (True, False, True, False)),
    "LHBNC": ((0, 2, 1, 3, 4), (1, 0, 2, 3), (True, False, False, False)),
    "BLHNC": ((1, 0, 2, 3, 4), (0, 1, 2, 3), (False, True, True, True)),
    "BLNHC": ((1, 0, 3, 2, 4), (0, 2, 1, 3), (False, False, True, True)),
    "BHLNC": ((1, 2, 0, 3, 4), (0, 1, 2, 3), (False, False, False, True)),
}


def test_members_in_tie_break_order():
    assert [layout.name for layout in KVCacheLayout] == list(REFERENCE)


@pytest.mark.parametrize("name", list(REFERENCE))
def test_properties_match_reference_table(name):
    value, view_order, predicates = REFERENCE[name]
    layout = KVCacheLayout[name]
    assert layout.value == value
    assert layout.stride_order == value
    assert layout.layer_view_order == view_order
    assert (
        layout.is_layer_compact,
        layout.is_block_contiguous,
        layout.is_block_compact,
        layout.is_block_outermost,
    ) == predicates


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("NHD", KVCacheLayout.LBNHC),
        ("HND", KVCacheLayout.LBHNC),
        ("BLHNC", KVCacheLayout.BLHNC),
        ("bhlnc", KVCacheLayout.BHLNC),
        (" nhd ", KVCacheLayout.LBNHC),
        (KVCacheLayout.LHBNC, KVCacheLayout.LHBNC),
    ],
)
def test_parse_accepts_names_and_aliases(name, expected):
    assert KVCacheLayout.parse(name) is expected


@pytest.mark.parametrize("bad", ["NDH", "", "LBHN", "BLHNCX", 3, None])
def test_parse_refuses_anything_else_listing_valid_names(bad):
    with pytest.raises(KVCacheLayoutError) as info:
        KVCacheLayout.parse(bad)
    message = str(info.value)
    for name in REFERENCE:
        assert name in message
    assert isinstance(info.value, ValueError)
