"""Spec validation: every rule rejects with a SpecError that names the field and the value."""

from __future__ import annotations

import pydantic
import pytest
import yaml

import fagen
from fagen.spec import AttentionSpec
from tests.conftest import BASE, base, rejected

# ---- a valid spec ----------------------------------------------------------------------


def test_base_spec_parses():
    spec = fagen.parse_spec(base())
    assert isinstance(spec, AttentionSpec)
    assert spec.name == "attn_f16_d128"
    assert spec.tiling.block_q == 64 and spec.tiling.block_kv == 64
    assert spec.pipeline.kv_smem == "separate"
    assert not spec.causal


def test_base_matches_the_committed_yaml():
    from fagen.load import SPECS

    assert yaml.safe_load((SPECS / "attn_f16_d128.yaml").read_text()) == BASE


def test_defaults_fill_optional_fields():
    minimal = {"name": "k", "dtype": "bfloat16", "head_dim": 64, "tiling": {"block_q": 64, "block_kv": 64}}
    spec = fagen.parse_spec(minimal)
    assert spec.tiling.warps_q == 4 and spec.tiling.warps_kv == 1
    assert spec.pipeline.kv_smem == "shared" and spec.pipeline.stages == 1
    assert spec.smem_layout == "padded" and spec.mask.kind == "none" and spec.arch == "sm_80"
    assert spec.outputs.lse is True


@pytest.mark.parametrize("assign", [
    lambda s: setattr(s, "head_dim", 64),
    lambda s: setattr(s.tiling, "block_q", 128),
    lambda s: setattr(s.pipeline, "stages", 2),
])
def test_spec_is_frozen(assign):
    spec = fagen.parse_spec(base())
    with pytest.raises(pydantic.ValidationError):
        assign(spec)
    assert spec == fagen.parse_spec(base())


def test_parse_spec_rejects_a_non_mapping():
    with pytest.raises(fagen.SpecError, match="expected a mapping"):
        fagen.parse_spec(["name", "k"])


# ---- one case per rule: (overrides, substrings the message must contain) -------------

RULES = {
    "unknown top-level key": (dict(foo=1), ["unknown key", "'foo'"]),
    "unknown nested key": (dict(tiling={"foo": 1}), ["unknown key", "tiling.foo"]),
    "dtype": (dict(dtype="float32"), ["dtype", "float32"]),
    "head_dim": (dict(head_dim=100), ["head_dim", "100", "[32, 64, 96, 128, 256]"]),
    "name uppercase": (dict(name="Flash_f16"), ["name", "Flash_f16", "lowercase"]),
    "name not an identifier": (dict(name="flash-f16"), ["name", "flash-f16", "identifier"]),
    "name starts with a digit": (dict(name="1flash"), ["name", "1flash"]),
    "warps_q 0": (dict(tiling={"warps_q": 0, "block_q": 64}), ["tiling.warps_q", "0", "1..8"]),
    "warps_q 9": (dict(tiling={"warps_q": 9, "block_q": 144}), ["tiling.warps_q", "9", "1..8"]),
    "warps_kv": (dict(tiling={"warps_kv": 3}), ["tiling.warps_kv", "3", "must be 1, 2, 4 or 8"]),
    "block_kv not a multiple of 16": (dict(tiling={"block_kv": 40}), ["tiling.block_kv", "40", "multiple of 16"]),
    "block_kv below 16": (dict(tiling={"block_kv": 0}), ["tiling.block_kv", "0", "16..256"]),
    "block_kv above 256": (dict(tiling={"block_kv": 272}), ["tiling.block_kv", "272", "16..256"]),
    "block_q not whole m16 rows": (dict(tiling={"block_q": 48}), ["tiling.block_q", "48", "16, 32, 48 or 64"]),
    "block_q over 64 rows a warp": (dict(tiling={"block_q": 320}), ["tiling.block_q", "320"]),
    "block_q under 16 rows a warp": (dict(tiling={"block_q": 32, "warps_q": 4}), ["tiling.block_q", "32"]),
    "stages": (dict(pipeline={"stages": 4}), ["pipeline.stages", "4"]),
    "kv_smem": (dict(pipeline={"kv_smem": "both"}), ["pipeline.kv_smem", "both"]),
    "swizzled d32": (dict(smem_layout="swizzled", head_dim=32), ["smem_layout", "swizzled", "head_dim 32"]),
    "swizzled d96": (dict(smem_layout="swizzled", head_dim=96), ["smem_layout", "swizzled", "head_dim 96"]),
}


@pytest.mark.parametrize("overrides, expected", RULES.values(), ids=RULES.keys())
def test_rule_rejects_and_names_field_and_value(overrides, expected):
    message = rejected(base(**overrides))
    for part in expected:
        assert part in message, f"{part!r} not in:\n{message}"


@pytest.mark.parametrize("section, field", [
    (None, "name"), (None, "dtype"), (None, "head_dim"), (None, "tiling"),
    ("tiling", "block_q"), ("tiling", "block_kv"),
])
def test_missing_required_field(section, field):
    data = base()
    del (data[section] if section else data)[field]
    message = rejected(data)
    where = f"{section}.{field}" if section else field
    assert f"{where} is required" in message


def test_smem_over_the_arch_limit():
    # d 256 padded -> rows of 264 elements; Q tile + 6 KV tiles (separate, 3 stages) of 64 rows.
    expected_bytes = (64 + 6 * 64) * 264 * 2
    message = rejected(base(arch="sm_86", head_dim=256, tiling={"block_kv": 64},
                            pipeline={"kv_smem": "separate", "stages": 3}))
    assert "pipeline" in message
    assert "separate, stages 3" in message
    assert str(expected_bytes) in message
    assert "sm_86" in message and "101376" in message


def test_the_same_pipeline_fits_a_bigger_arch():
    # sm_90 opts into 232448 bytes a block, sm_86 only 101376: the smem rule is per arch.
    fits = base(arch="sm_90", head_dim=256, tiling={"block_kv": 32}, pipeline={"kv_smem": "separate", "stages": 3})
    fagen.parse_spec(fits)
    rejected({**fits, "arch": "sm_86"})


def test_register_pressure():
    # sm_90 so that smem and the block-size budget pass and only the register rule fires.
    message = rejected(base(arch="sm_90", head_dim=256, tiling={"block_q": 64, "block_kv": 128}))
    assert "registers" in message
    assert "block_kv 128" in message
    assert "255" in message


def test_block_size_budget():
    # smem with one shared KV tile fits sm_80, but 2*Bc*d + Br*d + Br*Bc does not.
    expected = (2 * 128 * 256 + 64 * 256 + 64 * 128) * 2
    message = rejected(base(head_dim=256, tiling={"block_kv": 128}, pipeline={"kv_smem": "shared"}))
    assert "tiling" in message and "block_kv 128" in message
    assert str(expected) in message and "166912" in message


@pytest.mark.parametrize("overrides", [
    dict(head_dim=100),
    dict(tiling={"block_q": 48}),
    dict(tiling={"warps_kv": 3}),
    dict(tiling={"block_kv": 40}),
    dict(name="Flash"),
    dict(smem_layout="swizzled", head_dim=96),
    dict(arch="sm_86", head_dim=256, pipeline={"kv_smem": "separate", "stages": 3}),
    dict(arch="sm_90", head_dim=256, tiling={"block_kv": 128}),
    dict(foo=1),
])
def test_errors_suggest_a_fix(overrides):
    message = rejected(base(**overrides))
    assert any(word in message for word in ("use ", "pad ", "remove it", "instead")), message


def test_source_is_named_in_structural_errors():
    with pytest.raises(fagen.SpecError, match="specs/x.yaml"):
        fagen.parse_spec(base(head_dim=100), source="specs/x.yaml")


# ---- load_spec ---------------------------------------------------------------------------


def test_load_spec_reads_a_file(tmp_path):
    path = tmp_path / "my_kernel.yaml"
    path.write_text(yaml.safe_dump(base(name="my_kernel")))
    spec = fagen.load_spec(path)
    assert spec == fagen.parse_spec(base(name="my_kernel"))


def test_load_spec_rejects_a_stem_that_differs_from_name(tmp_path):
    path = tmp_path / "other_name.yaml"
    path.write_text(yaml.safe_dump(base(name="my_kernel")))
    with pytest.raises(fagen.SpecError) as info:
        fagen.load_spec(path)
    message = str(info.value)
    assert "name" in message and "my_kernel" in message and "other_name" in message


def test_load_spec_on_a_missing_file(tmp_path):
    path = tmp_path / "nowhere.yaml"
    with pytest.raises(fagen.SpecError) as info:
        fagen.load_spec(path)
    assert "nowhere.yaml" in str(info.value)


def test_load_spec_names_the_file_in_errors(tmp_path):
    path = tmp_path / "bad_dim.yaml"
    path.write_text(yaml.safe_dump(base(name="bad_dim", head_dim=100)))
    with pytest.raises(fagen.SpecError) as info:
        fagen.load_spec(path)
    assert str(path) in str(info.value) and "head_dim" in str(info.value)
