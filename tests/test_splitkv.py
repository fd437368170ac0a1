"""fagen.splitkv without a GPU: how many splits fill the GPU, and the partial variants."""

import pytest

import fagen
from fagen.load import SPECS
from fagen.plan import plan
from fagen.splitkv import choose_splits
from fagen.variants import partial_variant

SMS = 132  # an H100/H200


@pytest.mark.parametrize(("blocks", "kv_tiles", "expected"), [
    (SMS, 64, 1),  # the unsplit launch already fills the GPU
    (8, 3, 1),  # too few tiles to share
    (8, 64, 32),  # decode-like: two waves of blocks over the SMs
    (1, 10, 5),  # at least two KV tiles a split
])
def test_splits_fill_about_two_waves(blocks, kv_tiles, expected):
    splits = choose_splits(blocks, kv_tiles, SMS)
    assert splits == expected
    assert 1 <= splits <= max(1, kv_tiles // 2)


def test_a_partial_variant_writes_float32_partials_and_lse():
    spec = partial_variant(fagen.load_spec(SPECS / "attn_f16_d128.yaml"))
    assert spec.name == "attn_f16_d128_partial" and spec.outputs.partial and spec.outputs.lse
    assert [n for _, n in plan(spec).split_params] == ["kv_tiles_per_split", "o_split_stride", "lse_split_stride"]
    assert partial_variant(spec) is spec
