"""Decode kernels without a GPU: GQA packing's rules, which kernel a shape gets, the splits, the
rendered source and its registers."""

import math

import pytest

from fagen import dispatch, nvcc, variants
from fagen.load import SPECS, load_spec, parse_spec
from fagen.rendering import render
from fagen.spec import Mask, ScoreMod, SpecError

DECODE = load_spec(SPECS / "decode_f16_d128.yaml")


def packed(**changes) -> dict:
    data = DECODE.model_dump()
    for key, value in changes.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) and isinstance(data.get(key), dict) else value
    return data


@pytest.mark.parametrize("changes, field, fix", [
    ({"arch": "sm_90a", "smem_layout": "swizzled", "tiling": {"block_q": 64, "warps_q": 4, "warps_kv": 1, "block_kv": 64},
      "pipeline": {"stages": 2}},
     "tiling.pack_gqa", "arch: sm_80"),
    ({"mask": {"kind": "document"}}, "tiling.pack_gqa", "use none, causal"),
    ({"mask": {"kind": "block_mask"}}, "tiling.pack_gqa", "use none, causal"),
    ({"score_mod": {"bias": "vector"}}, "tiling.pack_gqa", "remove the bias"),
    ({"outputs": {"lse": True, "partial": False}, "backward": {}}, "tiling.pack_gqa", "remove backward"),
])
def test_packing_refuses_what_it_cannot_address(changes, field, fix):
    with pytest.raises(SpecError) as err:
        parse_spec(packed(**changes), "test")
    assert field in str(err.value) and fix in str(err.value) and "pack_gqa: false" in str(err.value)


@pytest.mark.parametrize("d, rows, name", [(128, 1, "decode_f16_d128"), (128, 16, "decode_f16_d128"),
                                           (128, 17, "decode_f16_d128_q64"), (128, 64, "decode_f16_d128_q64"),
                                           (128, 65, None), (96, 1, None), (256, 2, "decode_f16_d256"),
                                           (256, 16, "decode_f16_d256"), (256, 17, None)])
def test_the_packed_rows_pick_the_kernel(d, rows, name):
    spec = variants.decode_spec("float16", d, rows)
    assert (spec and spec.name) == name
    if spec is not None:
        assert spec.tiling.pack_gqa and spec.outputs.partial and spec.tiling.block_q >= rows


def test_no_decode_kernel_where_packing_does_not_apply():
    assert variants.decode_spec("float16", 96, 4) is None  # no shipped decode spec
    assert variants.decode_spec("float16", 128, 4, Mask(kind="document")) is None
    assert variants.decode_spec("bfloat16", 64, 4, Mask(), ScoreMod(bias="matrix")) is None
    spec = variants.decode_spec("bfloat16", 64, 8, Mask(kind="sliding_window", window_left=99), ScoreMod(softcap=5.0))
    assert spec.mask.window_left == 99 and spec.score_mod.softcap == 5.0 and spec.tiling.pack_gqa


@pytest.mark.parametrize("blocks, tiles, slots", [(8, 512, 396), (1, 2048, 396), (64, 64, 396), (600, 500, 396),
                                                  (8, 3, 396), (2, 1, 108), (33, 1000, 264)])
def test_splits_fill_one_wave_and_keep_a_tile_a_split(blocks, tiles, slots):
    splits = dispatch.choose_splits(blocks, tiles, slots)
    assert 1 <= splits <= max(1, tiles)
    assert splits == 1 or blocks * splits <= slots  # no block waits for a second wave
    if tiles > splits:  # tiles to spare: the wave is as full as it gets
        assert blocks * (splits + 1) > slots


def test_packed_source_maps_rows_to_heads_and_plain_source_does_not():
    source = render(DECODE)
    assert "struct QueryRows" in source and "copy_packed_q_async" in source and "b = bh / heads_kv" in source
    plain = render(load_spec(SPECS / "attn_f16_d128.yaml"))
    assert "QueryRows" not in plain and "heads_kv" not in plain


def _decode_base(d: int, rows: int):
    return load_spec(SPECS / f"{variants.decode_spec_name('float16', d, rows)}.yaml")


@pytest.mark.parametrize("d, rows", [(128, 16), (128, 64), (256, 16)])
def test_decode_variants_compile_without_spills(d, rows):
    specs = [variants.variant(_decode_base(d, rows), mask, mod.model_copy(update={"sinks": False})) for mask, mod in (
        (Mask(kind="sliding_window", window_left=1000, window_right=3), ScoreMod(softcap=30.0, alibi="slopes", sinks=True)),
        (Mask(kind="prefix_lm", prefix_len=1000), ScoreMod(softcap=30.0)))]
    for spec, res in zip(specs, nvcc.compile_many([(s, "sm_90") for s in specs])):
        assert res.spill_stores == 0 and res.spill_loads == 0, (spec.name, res.log)


@pytest.mark.parametrize("changes, message", [
    ({"tiling": {"warps_kv": 3}}, "must be 1, 2, 4 or 8"),
    ({"tiling": {"block_kv": 32, "warps_kv": 4}}, "whole k16 steps of P.V"),
    ({"tiling": {"block_q": 64, "warps_q": 4, "warps_kv": 4}}, "makes 16 warps, over 8"),
    ({"tiling": {"pack_gqa": False}, "mask": {"kind": "document"}}, "reads arrays by tile"),
    ({"tiling": {"pack_gqa": False}, "outputs": {"lse": True, "partial": False}, "backward": {}}, "remove backward"),
])
def test_warps_along_the_keys_refuse_what_they_cannot_split(changes, message):
    with pytest.raises(SpecError) as err:
        parse_spec(packed(**changes), "test")
    assert "tiling.warps_kv" in str(err.value) and message in str(err.value)


def test_warps_along_the_keys_share_each_tile():
    """Each of the decode kernel's warps takes block_kv / warps_kv keys of a tile: its S and P.V
    shrink by warps_kv, the rows stay whole, and the epilogue merges the warps' softmax states."""
    from fagen.plan import plan

    p = plan(DECODE)  # 256-key tiles over 4 warps
    assert (p.warps_q, p.warps_kv, p.warp_keys, p.threads) == (1, 4, 64, 128)
    assert (p.s_n_frags, p.pv_k_steps, p.warp_rows) == (8, 4, 16)
    assert p.key_merge_floats == 64 + 4  # a lane's O (16 rows x 128 / 32) and a max and sum a row half
    source = render(DECODE)
    assert "merge_key_warps(o_acc, softmax" in source and "warp_key0 = warp / WARPS_Q * WARP_KEYS" in source
    one = render(load_spec(SPECS / "attn_f16_d128.yaml"))
    assert "merge_key_warps" not in one and "WARPS_KV" not in one


# ---- unsplit: the blocks fill the GPU, half the ring each ----------------------------------------

@pytest.mark.parametrize("head_dim, tiling, stages, half", [
    (64, {"block_kv": 256, "warps_kv": 4}, 2, {"pipeline": 1}),  # d64's: one stage of two
    (128, {"block_kv": 256, "warps_kv": 4}, 1, {"block_kv": 128}),  # d128's: half the keys, 32 a warp
    (128, {"block_kv": 128, "warps_kv": 4}, 1, {}),  # 16 keys a warp would be left
    (128, {"block_kv": 64, "warps_kv": 2}, 1, {}),
])
def test_halved_ring_halves_stages_before_keys(head_dim, tiling, stages, half):
    spec = parse_spec(packed(head_dim=head_dim, tiling=tiling, pipeline={"stages": stages}), "test")
    changes = variants.halved_ring(spec)
    if "pipeline" in half:
        assert changes["pipeline"]["stages"] == half["pipeline"] and "tiling" not in changes
    elif half:
        assert changes["tiling"]["block_kv"] == half["block_kv"] and "pipeline" not in changes
    else:
        assert changes == {}


@pytest.mark.parametrize("path", sorted(SPECS.glob("decode_*.yaml")), ids=lambda p: p.stem)
def test_an_unsplit_kernel_shares_its_sm_where_its_blocks_overfill_the_gpu(path):
    """Unsplit, more blocks than the GPU holds at once: a 16-row kernel's ring halves so that two
    blocks fit an SM (228 KB on sm_80-sm_90) and the batch runs in one wave, not two; a 64-row
    kernel keeps its ring (one warp a row group, or a halved ring too small for the key warps'
    merge), as does any kernel whose blocks fit the GPU a block an SM, or two already (head_dim
    256's 64-key ring)."""
    from fagen.plan import plan

    spec = load_spec(path)
    whole, half = variants.unsplit_variant(spec), variants.unsplit_variant(spec, half_ring=True)
    for unsplit in (whole, half):
        assert not unsplit.outputs.partial and unsplit.outputs.lse
    assert (whole.tiling, whole.pipeline) == (spec.tiling, spec.pipeline)
    if spec.tiling.block_q == 16 and 2 * plan(whole).smem_bytes > 228 * 1024:
        assert 228 * 1024 >= 2 * plan(half).smem_bytes
        assert half.name == f"{spec.name}_unsplit_half" and half.tiling.block_kv // half.tiling.warps_kv >= 32
    else:
        assert half == whole


# ---- one launch a step: the last split of each tile merges (outputs.merge_splits) ----------------

def test_a_merging_variant_keeps_its_partials_and_takes_the_sinks():
    merged = variants.merged_variant(DECODE, sinks=True)
    assert merged.name == "decode_f16_d128_merged_sinks" and merged.outputs.partial and merged.outputs.merge_splits
    assert merged.score_mod.sinks and merged.tiling == DECODE.tiling
    assert variants.merged_variant(merged) is merged  # already merging
    plain = load_spec(SPECS / "attn_f16_d128.yaml")
    assert variants.merged_variant(plain) is plain  # no partials to merge


@pytest.mark.parametrize("changes, broken", [
    ({"outputs": {"lse": True, "partial": False, "merge_splits": True}}, "needs outputs.partial"),
    ({"outputs": {"lse": True, "partial": True, "accumulate": True, "merge_splits": True},
      "tiling": {"pack_gqa": False}}, "no accumulate"),
    ({"outputs": {"lse": True, "partial": True, "merge_splits": True}, "sequences": {"q": "varlen", "kv": "varlen"}},
     "padded positions"),
])
def test_merging_refuses_what_it_cannot_merge(changes, broken):
    with pytest.raises(SpecError) as err:
        parse_spec(packed(**changes), "test")
    assert "outputs.merge_splits" in str(err.value) and broken in str(err.value)


@pytest.mark.parametrize("path", sorted(SPECS.glob("decode_*.yaml")), ids=lambda p: p.stem)
def test_the_idle_ring_holds_the_merging_threads_shares(path):
    from fagen.plan import plan

    p = plan(variants.merged_variant(load_spec(path)))
    assert p.kv_slots * p.kv_tile_bytes >= p.threads * p.split_merge_floats * 4


@pytest.mark.parametrize("rows, d, splits, one_launch", [
    (4, 128, 16, True),  # Nq 1, GQA 4: 32 KB, merged 0.5 us faster in the kernel (H200)
    (4, 64, 32, True), (8, 128, 16, True), (1, 128, 128, True),
    (16, 128, 16, False),  # Nq 4: 128 KB, 4.6 us slower read back by one block
    (64, 128, 16, False),
])
def test_small_partials_merge_in_the_kernel(rows, d, splits, one_launch):
    assert dispatch.merges_in_kernel(rows, d, splits) is one_launch


def test_the_merging_kernel_renders_its_merge_and_nothing_else_does():
    for sinks in (False, True):
        source = render(variants.merged_variant(DECODE, sinks=sinks))
        assert "last_split_to_arrive(split_counts + blockIdx.x * gridDim.y + blockIdx.y, gridDim.z, tid)" in source
        assert "merge_splits(o_split0, lse_split0" in source
        signature = source[source.index("fagen_decode_f16_d128_merged"):source.index(") {", source.index("fagen_decode"))]
        for param in ("merged_o", "merged_sn", "merged_lse", "split_counts"):
            assert param in signature
        assert ("sinks" in signature) is sinks
        assert source.count("__shared__") == 1  # the dynamic tiles alone: a static one shifts the swizzle
        # a split counts itself in with one acquire-release atomic: no sequentially consistent fences
        assert "atom.add.acq_rel.gpu.global.s32" in source and "__threadfence" not in source
    partial = render(DECODE)
    assert "last_split_to_arrive" not in partial and "merged_o" not in partial


def test_a_merging_plan_packs_the_merge_parameters_after_the_splits():
    from fagen.plan import plan

    names = [name for _, name in plan(variants.merged_variant(DECODE, sinks=True)).extra_params]
    split = names.index("lse_split_stride")
    assert names[split + 1:split + 8] == ["merged_o", "merged_sb", "merged_sh", "merged_sn", "merged_lse",
                                          "split_counts", "sinks"]


class _Tensor:
    """What ShapeClasses reads of a CUDA tensor, without one."""

    def __init__(self, *shape, device=0):
        self.shape, self._device, self.dtype = shape, device, "float16"

    def stride(self):
        return tuple(math.prod(self.shape[i + 1:]) for i in range(len(self.shape)))

    def get_device(self):
        return self._device

    def data_ptr(self):
        return 4096


class _CPath:
    """A kept class's C path (HotPath): what a remembered class takes alone."""

    def __init__(self, owner):
        self.owner = owner

    def run(self, q, k, v, *indices_and_out):
        self.owner.calls.append("kept")
        return NotImplemented if self.owner.declines else "out"


class _Class:
    """A kept class that records how it was called: its C path alone ("kept") or `run` (after
    the whole key's lookup)."""

    def __init__(self, declines: bool = False):
        self._hot, self.declines, self.calls = _CPath(self), declines, []

    def run(self, q, k, v, given, return_lse):
        self.calls.append("run")
        return "out"


def test_shape_classes_try_the_class_a_call_with_the_same_options_last_took(monkeypatch):
    """A model's layers call with the same options: after one call through the whole key, a call
    with those options (and q's shape, stream, thread, key-range pattern) goes to the remembered
    class's C path, which checks the tensors; where it declines (a class boundary crossed), the
    whole key finds the call's class. Other options, or an LSE asked for, take the whole key."""
    import threading

    from fagen.decode import ShapeClasses

    classes = ShapeClasses()
    classes._stream = lambda device: 7
    made = []

    def add(base, exact_key, q, k, v, options, given, return_lse):  # the kernel's packing, stubbed
        made.append(_Class(declines=len(made) == 0))
        classes._growing[(*base, k.shape[2].bit_length())] = made[-1]
        return made[-1].run(q, k, v, given, return_lse)

    monkeypatch.setattr(classes, "_add", add)
    q = _Tensor(1, 32, 1, 128)
    call = lambda n, **o: classes(q, _Tensor(1, 8, n, 128), _Tensor(1, 8, n, 128), o.get("causal", True), None,
                                  None, None, None, o.get("return_lse", False))
    assert call(1000) == "out" and made[0].calls == ["run"]  # packed
    assert call(1001) == "out" and made[0].calls == ["run", "run"]  # the whole key, then remembered
    made[0].declines = False
    assert call(1002) == "out" and made[0].calls == ["run", "run", "kept"]  # the remembered class alone
    made[0].declines = True
    assert call(1030) == "out" and made[1].calls == ["run"]  # declined (a new class): the whole key, packed
    assert call(1031) == "out" and made[0].calls[-1] == "kept" and made[1].calls == ["run", "run"]
    assert call(1032) == "out" and made[1].calls[-1] == "kept"  # the new class remembered
    before = [len(c.calls) for c in made]
    assert call(1033, return_lse=True) == "out" and len(made) == 3  # an LSE: the whole key (its own class)
    assert call(1034, causal=False) == "out" and len(made) == 4  # other options: their own class
    assert [len(c.calls) for c in made[:2]] == before
    other = []
    worker = threading.Thread(target=lambda: other.append(call(1035)))
    worker.start(), worker.join()
    assert other == ["out"] and len(made) == 5 and made[4].calls == ["run"]  # another thread: its own class


def test_the_remembered_class_is_keyed_by_every_option_the_c_path_does_not_check(monkeypatch):
    """The memo's key: a dict mask by its items, the sinks by address and version, which of the key
    ranges are given, an FP8 cache's descales (numbers by value; a descale the class copied is not
    remembered: each call finds its class by the whole key, which holds its address and version);
    each other value is another class. At LIMIT entries the memo starts over."""
    from fagen.decode import ShapeClasses

    classes = ShapeClasses()
    classes._stream = lambda device: 7
    made = []

    def add(base, exact_key, q, k, v, options, given, return_lse):
        made.append(_Class())
        classes._growing[(*base, k.shape[2].bit_length())] = made[-1]
        return made[-1].run(q, k, v, given, return_lse)

    monkeypatch.setattr(classes, "_add", add)
    q = _Tensor(1, 32, 1, 128)
    kv = (_Tensor(1, 8, 1000, 128), _Tensor(1, 8, 1000, 128))

    class Sinks(_Tensor):
        def __init__(self, at):
            super().__init__(32)
            self.at, self._version = at, 0

        def data_ptr(self):
            return self.at

    def call(mask=None, sinks=None, ranges=(), descales=()):
        before = [len(c.calls) for c in made]
        assert classes(q, *kv, True, mask, None, None, sinks, False, ranges, descales) == "out"
        assert classes(q, *kv, True, mask, None, None, sinks, False, ranges, descales) == "out"  # remembered now
        return [c.calls[n:] for c, n in zip(made, before)] + [c.calls for c in made[len(before):]]

    window = {"kind": "sliding_window", "window_left": 300}
    assert call(mask=window)[-1] == ["run", "run"]  # packed, then remembered
    assert call(mask=dict(window))[0] == ["kept", "kept"]  # an equal dict: the same class
    assert call(mask={**window, "window_left": 200})[-1] == ["run", "run"] and len(made) == 2
    sinks = Sinks(8192)
    assert call(sinks=sinks)[-1] == ["run", "run"] and len(made) == 3
    sinks._version += 1  # written in place: the packing read its values
    assert call(sinks=sinks)[-1] == ["run", "run"] and len(made) == 4
    lengths = _Tensor(1)
    assert call(ranges=(lengths, None))[-1] == ["run", "run"] and len(made) == 5
    assert call(ranges=(None, lengths))[-1] == ["run", "run"] and len(made) == 6  # the other range given
    assert call(descales=(None, 2.0, 0.5))[-1] == ["run", "run"] and len(made) == 7
    assert call(descales=(None, 2.0, 0.5))[-1] == ["kept", "kept"] and len(made) == 7  # the same class
    assert call(descales=(None, 2.0, 0.25))[-1] == ["run", "run"] and len(made) == 8  # another number
    k_descale = Sinks(12288)  # a tensor the class copies (not float32 on q's GPU): never remembered
    assert call(descales=(None, k_descale, 0.25))[-1] == ["run", "run"] and len(made) == 9
    assert call(descales=(None, k_descale, 0.25))[-1] == ["run", "run"] and len(made) == 9  # by the whole key
    k_descale._version += 1  # written in place: the packing copied its values
    assert call(descales=(None, k_descale, 0.25))[-1] == ["run", "run"] and len(made) == 10
    assert call(descales=(0.5, 2.0, 0.25))[-1] == ["run", "run"] and len(made) == 11  # an FP8 q's descale
    assert len(classes._last) == 9
    monkeypatch.setattr(ShapeClasses, "LIMIT", 9)
    call(mask="causal")  # the tenth: the memo starts over
    assert list(classes._last.values()) == [made[-1]._hot.run]


class _Float32:
    """torch.float32 as fp8_inputs.kept_form reads it (one object, as torch's dtypes are)."""

    def __str__(self):
        return "torch.float32"


FLOAT32 = _Float32()


class _Descale(_Tensor):
    """A float32 descale tensor as fp8_inputs.kept_form reads one (its type's module is torch's)."""

    __module__ = "torch.stand_in"

    def __init__(self, at, shape=(1, 8), device=0):
        super().__init__(*shape, device=device)
        self.dtype, self.at, self._version = FLOAT32, at, 0

    def data_ptr(self):
        return self.at


def test_a_call_s_descale_tensors_go_to_the_remembered_class_s_c_path_as_they_are(monkeypatch):
    """A decode loop's fresh descale tensor each call (a dynamic scale): after the whole key has
    found the class once, a call with the same options takes its C path with the tensors after
    the key ranges, unread (the C path checks their layout, dtype and GPU); numbers stay in the
    options by value (another number: the whole key again)."""
    from fagen.decode import ShapeClasses

    classes = ShapeClasses()
    classes._stream = lambda device: 7
    made, hot = [], []

    class Class(_Class):
        def __init__(self):
            super().__init__()
            self._hot.run = lambda q, k, v, *given: hot.append(given[:-1]) or "out"

    def add(base, exact_key, q, k, v, options, given, return_lse):
        made.append(Class())
        classes._growing[(*base, k.shape[2].bit_length())] = made[-1]
        return "out"

    monkeypatch.setattr(classes, "_add", add)
    q, k, v = _Descale(1, shape=(1, 32, 1, 128)), _Descale(2, shape=(1, 8, 1000, 128)), _Descale(3, shape=(1, 8, 1000, 128))
    lengths = _Descale(4, shape=(1,))
    call = lambda *descales: classes(q, k, v, True, None, None, None, None, False, (lengths, None), descales)
    fresh = [(_Descale(1 << (20 + i)), _Descale(1 << (40 + i))) for i in range(4)]
    assert call(2.0, *fresh[0]) == "out" and len(made) == 1 and not hot  # packed
    assert call(2.0, *fresh[1]) == "out" and made[0].calls == ["run"] and not hot  # the whole key, then remembered
    assert call(2.0, *fresh[2]) == "out" and hot == [(lengths, *fresh[2])] and made[0].calls == ["run"]
    assert call(0.5, *fresh[3]) == "out" and len(made) == 2 and len(hot) == 1  # another number: its own class


def test_float32_descales_on_q_s_gpu_are_re_pointed_each_call_not_keyed(monkeypatch):
    """A dynamic scale is a fresh tensor each call: float32 descales on q's GPU are keyed by their
    layout and handed to the class after the key ranges (its C path re-points them), so fresh
    tensors and in-place writes keep the class; which descales are given stays in the key, and a
    descale on another GPU is keyed by address and version as before (its values copied)."""
    from fagen.decode import ShapeClasses

    classes = ShapeClasses()
    classes._stream = lambda device: 7
    made, seen = [], []

    class Class(_Class):
        def __init__(self, options):
            super().__init__()
            self.moving = options["moving_descales"]
            self._hot.run = lambda q, k, v, *given: seen.append(given[:-1]) or "out"

        def run(self, q, k, v, given, return_lse):
            seen.append(given)
            return "out"

    def add(base, exact_key, q, k, v, options, given, return_lse):
        made.append(Class(options))
        classes._growing[(*base, k.shape[2].bit_length())] = made[-1]
        seen.append(given)
        return "out"

    monkeypatch.setattr(classes, "_add", add)
    q = _Tensor(1, 32, 1, 128)
    kv = (_Tensor(1, 8, 1000, 128), _Tensor(1, 8, 1000, 128))
    call = lambda *descales: classes(q, *kv, True, None, None, None, None, False, (), descales)
    kd, vd = _Descale(1 << 20), _Descale(1 << 21)
    assert call(None, kd, vd) == "out" and made[0].moving == ("k_descale", "v_descale") and seen[-1] == (kd, vd)
    fresh_k, fresh_v = _Descale(1 << 22), _Descale(1 << 23)
    fresh_k._version = 5
    assert call(None, fresh_k, fresh_v) == "out" and len(made) == 1 and seen[-1] == (fresh_k, fresh_v)
    assert call(None, None, vd) == "out" and len(made) == 2 and made[1].moving == ("v_descale",)
    assert call(None, vd, None) == "out" and len(made) == 3  # the same layout as the other descale: its own class
    assert call(None, _Descale(1 << 24, shape=(1,)), vd) == "out" and len(made) == 4  # another layout
    elsewhere = _Descale(1 << 25, device=1)  # another GPU's: copied when the class is made, keyed by address
    assert call(None, elsewhere, vd) == "out" and len(made) == 5 and made[4].moving == ("v_descale",)
    elsewhere._version += 1
    assert call(None, elsewhere, vd) == "out" and len(made) == 6


def test_the_shipped_fp8_kv_spec_is_the_variant_fagen_attention_derives():
    """specs/decode_bf16_d128_kv_e4m3.yaml is fp8_kv_variant of the bfloat16 decode spec, field for
    field: the file a reader renders is the kernel a float8 cache runs."""
    shipped = load_spec(SPECS / "decode_bf16_d128_kv_e4m3.yaml")
    derived = variants.fp8_kv_variant(variants.decode_spec("bfloat16", 128, 4), "float8_e4m3")
    assert derived == shipped
    assert derived.fp8_kv and derived.mma_element.name == "float16" and derived.kv_element.bytes == 1


@pytest.mark.parametrize("dtype, kv_dtype, rows, head_dim", [("bfloat16", "float8_e4m3", 16, 128),
                                                         ("float16", "float8_e5m2", 64, 128),
                                                         ("bfloat16", "float8_e4m3", 16, 64),
                                                         ("bfloat16", "float8_e4m3", 16, 256)])
def test_fp8_kv_decode_kernels_compile_without_spills(dtype, kv_dtype, rows, head_dim):
    """Every kernel a decode step of an FP8 cache may launch (split, merging its splits, unsplit,
    unsplit on half the ring), with a window, softcap and ALiBi: 0 spills; their K/V ring holds
    the half-type kernel's bytes (twice the stages of half the bytes a key), at head_dim 64 two
    thirds of them or more (three stages, the most there are; the half type's rows are padded)."""
    half = variants.decode_spec(dtype, head_dim, rows)
    base = variants.fp8_kv_variant(variants.variant(half, Mask(kind="sliding_window", window_left=900, window_right=0),
                                                    ScoreMod(softcap=30.0, alibi="slopes")), kv_dtype)
    specs = [base, variants.merged_variant(base), variants.unsplit_variant(base),
             variants.unsplit_variant(base, half_ring=True)]
    from fagen.plan import plan
    held, half_held = plan(base).kv_slots * plan(base).kv_tile_bytes, plan(half).kv_slots * plan(half).kv_tile_bytes
    assert held == half_held if head_dim == 128 else 3 * held >= 2 * half_held  # (d256's half type: one padded stage)
    for spec, res in zip(specs, nvcc.compile_many([(s, "sm_90") for s in specs])):
        assert res.spill_stores == 0 and res.spill_loads == 0, (spec.name, res.log)


@pytest.mark.parametrize("rows, head_dim", [(4, 128), (16, 64), (16, 256), (200, 128), (200, 64)])
def test_an_fp8_q_is_widened_by_the_cache_s_kernels_as_it_lands(rows, head_dim):
    """FP8 q, k, v of a decode step run on the FP8 cache's kernels (dispatch.fp8_kv_spec with
    q_dtype): each takes q's bytes (16 values a copy) and widens them in shared memory, its name
    saying so; a chunk of prefill (more rows than a decode kernel holds) too. Every kernel such a
    step launches first at d128, and a d64 chunk's (d64 has no FP8 forward), compiles without spills."""
    plain = variants.decode_spec("bfloat16", head_dim, min(rows, 64))
    spec = dispatch.fp8_kv_spec(plain, rows, "float8_e4m3", "float8_e4m3")
    assert spec.widens_query and spec.q_element.bytes == 1 and spec.name.endswith("_kv_e4m3_q_e4m3")
    assert dispatch.fp8_kv_spec(plain, rows, "float8_e4m3").widens_query is False
    source = render(spec)
    assert "const q_elem_t* __restrict__ q," in source and "widen_q(smem_q, tid);" in source
    assert "q_to_float16" not in source and "q_unscale" not in source  # (a bfloat16 q's rescale)
    if rows == 200 or head_dim == 128:  # (d64's and d256's decode kernels differ in their tiles alone: rendered)
        # the split kernel (the merging and unsplit ones load and widen Q alike: CPU time)
        (res,) = nvcc.compile_many([(spec, "sm_90")])
        assert res.spill_stores == 0 and res.spill_loads == 0 and res.stack_frame == 0, (spec.name, res.log)


def test_an_fp8_q_is_derived_as_the_cache_s_decode_step_or_refused_by_name(monkeypatch):
    """derive_spec (fagen.prepare, decode.attention, the kept classes) takes an FP8 q beside FP8 v
    on the FP8 cache's kernels only where fagen.attention would (fp8_on_cache_kernels); other
    shapes are the FP8 forward's (fagen.attention), refused here with that fix, never run on a
    chunk kernel fagen.attention would not pick; an FP8 q of another type than v's is refused by
    name."""
    from fagen.device import DeviceTensor

    monkeypatch.setattr(dispatch.device, "cupy", object())  # a GPU to fill: an H200's 132 SMs
    monkeypatch.setattr(dispatch.device, "current_device", lambda: 0)
    monkeypatch.setattr(dispatch.device, "multiprocessors", lambda device: 132)

    def tensor(shape, dtype="float8_e4m3fn"):
        return DeviceTensor(None, "torch", 0, shape, (0,) * len(shape), dtype, 0)

    cache = tensor((1, 8, 4096, 128))
    assert dispatch._fp8_query_dtype(tensor((1, 32, 1, 128)), cache) == "bfloat16"
    assert dispatch._fp8_query_dtype(tensor((1, 32, 2, 128)), cache, causal=True) == "bfloat16"
    assert dispatch._fp8_query_dtype(tensor((1, 8, 300, 128)), tensor((1, 8, 300, 128))) == "bfloat16"  # chunks
    with pytest.raises(ValueError, match=r"FP8 q, k and v run the FP8 forward.*call fagen.attention"):
        dispatch._fp8_query_dtype(tensor((4, 32, 512, 128)), tensor((4, 8, 512, 128)), causal=True)
    with pytest.raises(ValueError, match=r"FP8 q, k and v run the FP8 forward"):  # a bias: the forward's alone
        dispatch._fp8_query_dtype(tensor((1, 32, 1, 128)), cache, bias=1)
    with pytest.raises(ValueError, match=r"q: float8_e5m2 against a float8_e4m3fn cache.*pass q as float8_e4m3fn"):
        dispatch._fp8_query_dtype(tensor((1, 32, 1, 128), "float8_e5m2"), cache)
    assert dispatch._fp8_query_dtype(tensor((1, 32, 1, 128)), tensor((1, 8, 4096, 128), "bfloat16")) == "float8_e4m3fn"


@pytest.mark.parametrize("q_shape, k_shape, options, decodes", [
    ((1, 32, 1, 128), (1, 8, 32768, 128), {}, True),  # a decode step: 4 packed rows a KV head
    ((2, 32, 16, 128), (2, 8, 4096, 128), {"causal": True}, True),  # 64 rows: the q64 kernel
    # more rows: the cache's chunk kernels where the FP8 forward would fill under CHUNKS_BELOW_FORWARD_FILL
    ((2, 32, 17, 128), (2, 8, 4096, 128), {}, True),  # 68 rows, 64 forward blocks of 17 rows in 128
    ((1, 32, 128, 128), (1, 8, 16384, 128), {"causal": True}, True),  # fill 0.24 (measured: chunks 1.29x)
    ((4, 32, 64, 128), (4, 8, 16384, 128), {"causal": True}, False),  # fill 0.48 (measured: the forward 1.19x)
    ((4, 32, 128, 128), (4, 8, 8192, 128), {"causal": True}, False),  # fill 0.97 (the forward 2x)
    ((16, 32, 32, 128), (16, 8, 4096, 128), {"causal": True}, True),  # fill 0.25: rows of a tile (chunks 1.83x)
    ((4, 32, 512, 64), (4, 8, 8192, 64), {"causal": True}, True),  # d64: no FP8 forward, the chunks
    ((4, 8, 1, 64), (4, 2, 900, 64), {"softcap": 30.0, "sinks": 1, "alibi_slopes": 1}, True),
    ((4, 8, 4, 256), (4, 2, 900, 256), {}, True),  # 16 rows: d256's one decode kernel
    ((4, 8, 5, 256), (4, 2, 900, 256), {}, False),  # d256: no chunk kernel measured, the forward
    ((1, 8, 1, 96), (1, 8, 900, 96), {}, False),  # no FP8 cache kernel at 96
    ((1, 8, 0, 128), (1, 8, 900, 128), {}, False),  # no rows: the forward's own no-work answer
    ((1, 32, 1, 128), (1, 8, 4096, 128), {"bias": 1}, False),  # side inputs of the FP8 forward's alone
    ((1, 32, 1, 128), (1, 8, 4096, 128), {"doc_ids": 1}, False),
    ((1, 32, 1, 128), (1, 8, 4096, 128), {"mask": {"kind": "sliding_window", "window_left": 256}}, True),
    ((1, 30, 1, 128), (1, 8, 4096, 128), {}, False),  # heads not grouped: refused by the forward's checks
    ((1, 32, 1, 128), (1, 8, 4096, 128), {"softcap": [30.0]}, False),  # not a number: refused there by name
])
def test_fp8_q_k_v_of_few_rows_a_kv_head_take_the_fp8_cache_kernels(monkeypatch, q_shape, k_shape, options, decodes):
    """FP8 q, k, v with few query rows a KV head run on an FP8 KV cache's kernels (q widened as it
    lands): GQA packed and the keys split, where the FP8 forward's 128-row tiles would hold a
    head's few rows each; more rows where the forward would fill little of an H200 (132 SMs);
    another head width or the forward's own side inputs keep the forward."""
    monkeypatch.setattr(dispatch.device, "gpu_slug", lambda: "h200")
    monkeypatch.setattr(dispatch.device, "cupy", object())
    monkeypatch.setattr(dispatch.device, "multiprocessors", lambda device: 132)
    for kv in ("float8_e4m3", "float8_e5m2"):
        assert dispatch.fp8_on_cache_kernels(q_shape, k_shape, k_shape, kv, gpu=0, **options) is decodes
    if q_shape[2] * q_shape[1] // k_shape[1] > 64:  # more rows than a decode kernel holds:
        # with key ranges, the forward (which refuses them by name) at every fill
        assert not dispatch.fp8_on_cache_kernels(q_shape, k_shape, k_shape, "float8_e4m3", gpu=0, ranged=True, **options)
        monkeypatch.setattr(dispatch.device, "cupy", None)  # no GPU to fill: the forward
        assert not dispatch.fp8_on_cache_kernels(q_shape, k_shape, k_shape, "float8_e4m3", **options)


def test_a_chunk_of_prefill_on_an_fp8_cache_takes_128_row_tiles_that_fit():
    """More packed rows than a decode kernel holds: 128 rows a tile on one key warp a row group,
    the widest key tile the registers fit (d128: 128 keys, 64 beside a window with softcap and
    ALiBi; d64: 128), its split, merging and unsplit kernels free of spills; d256 keeps its
    decode kernel's tiles."""
    window = Mask(kind="sliding_window", window_left=900, window_right=0)
    causal128 = variants.fp8_kv_chunk_variant(variants.decode_spec("bfloat16", 128, 64, Mask(kind="causal")),
                                              "float8_e4m3")
    window128 = variants.fp8_kv_chunk_variant(variants.decode_spec("bfloat16", 128, 64, window,
                                                                   ScoreMod(softcap=30.0, alibi="slopes")), "float8_e4m3")
    window64 = variants.fp8_kv_chunk_variant(variants.decode_spec("float16", 64, 64, window, ScoreMod(softcap=30.0)),
                                             "float8_e5m2")
    assert [(s.tiling.block_q, s.tiling.warps_kv, s.tiling.block_kv) for s in (causal128, window128, window64)] == [
        (128, 1, 128), (128, 1, 64), (128, 1, 128)]
    d256 = variants.decode_spec("bfloat16", 256, 16)
    assert variants.fp8_kv_chunk_variant(d256, "float8_e4m3") == variants.fp8_kv_variant(d256, "float8_e4m3")
    specs = [causal128, variants.unsplit_variant(window128, half_ring=True), variants.merged_variant(window64)]
    for spec, res in zip(specs, nvcc.compile_many([(s, "sm_90") for s in specs])):
        assert res.spill_stores == 0 and res.spill_loads == 0, (spec.name, res.log)


def test_an_fp8_cache_takes_the_fp8_variant_of_the_decode_kernel(monkeypatch):
    """dispatch.packed_spec on a float8 k: the decode kernel's FP8 variant; more packed rows than
    the largest decode kernel holds (a chunk of prefill): that kernel's, over several row tiles
    (no other kernel reads an FP8 cache); head_dim 64 (three stages) and 256 (16 keys a key warp)
    too; 96: none (the call then refuses). Only shapes
    and dtypes are read: stand-ins replace the tensors."""
    from types import SimpleNamespace

    monkeypatch.setattr(dispatch, "as_device_tensor", lambda x, what: x)
    plain = variants.shipped_spec("bfloat16", 128, False, gpu=None)
    k8 = SimpleNamespace(shape=(2, 8, 4096, 128), dtype="float8_e4m3fn")
    spec = dispatch.packed_spec(plain, SimpleNamespace(shape=(2, 32, 1, 128), dtype="bfloat16"), k8)
    assert spec.name == "decode_bf16_d128_kv_e4m3" and spec.kv_dtype == "float8_e4m3"
    chunk = dispatch.packed_spec(plain, SimpleNamespace(shape=(2, 32, 64, 128), dtype="bfloat16"), k8)
    assert chunk.name == "decode_bf16_d128_q64_rows128x128_kv_e4m3" and chunk.tiling.block_q == 128
    plain64 = variants.shipped_spec("bfloat16", 64, False, gpu=None)
    k8_64 = SimpleNamespace(shape=(2, 8, 4096, 64), dtype="float8_e4m3fn")
    spec64 = dispatch.packed_spec(plain64, SimpleNamespace(shape=(2, 32, 1, 64), dtype="bfloat16"), k8_64)
    assert spec64.name == "decode_bf16_d64_kv_e4m3" and spec64.pipeline.stages == 3  # (two already: three at most)
    plain256 = variants.shipped_spec("bfloat16", 256, False, gpu=None)
    k8_256 = SimpleNamespace(shape=(2, 8, 4096, 256), dtype="float8_e4m3fn")
    spec256 = dispatch.packed_spec(plain256, SimpleNamespace(shape=(2, 32, 1, 256), dtype="bfloat16"), k8_256)
    assert spec256.name == "decode_bf16_d256_kv_e4m3" and spec256.tiling.block_kv // spec256.tiling.warps_kv == 16
    plain96 = variants.shipped_spec("float16", 96, False, gpu=None)
    k8_96 = SimpleNamespace(shape=(2, 8, 4096, 96), dtype="float8_e4m3fn")
    assert dispatch.packed_spec(plain96, SimpleNamespace(shape=(2, 32, 1, 96), dtype="float16"), k8_96) is None
