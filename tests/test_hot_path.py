"""fagen.hot_path without a GPU: the C hot path of a prepared call, built with this machine's
compiler and driven with torch-like tensors and recording stand-ins for the driver's
cuLaunchKernelEx, cuStreamIsCapturing (whose config layout test_dependent_launch checks
against cuda.h) and cuTensorMapEncodeTiled."""

import ctypes

import numpy as np
import pytest

from fagen import hot_path
from fagen.dependent_launch import PROGRAMMATIC_STREAM_SERIALIZATION, _Config

LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                          ctypes.c_void_p)
IS_CAPTURING = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))
_U64, _U32 = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
ENCODE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, _U64, _U64,
                          _U32, _U32, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int)
MAP_FLAGS = (0, 3, 2, 0)  # tensor_maps.ENCODE_FLAGS: the C side passes them through
FLOAT16 = object()  # a dtype: compared by identity, as torch's are
STREAM = 0x5EED


class Tensor:
    """What the hot path reads of a torch tensor."""

    def __init__(self, shape, address, dtype=FLOAT16, device=0, stride=None):
        self.shape, self.dtype, self._device, self._address = tuple(shape), dtype, device, address
        self._stride = stride or tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))

    def stride(self):
        return self._stride

    def is_contiguous(self):  # torch's rule: dimensions of one skipped, no element contiguous
        expected = 1
        for size, stride in reversed(tuple(zip(self.shape, self._stride))):
            if size != 1:
                if stride != expected:
                    return 0 in self.shape
                expected *= size
        return True

    def get_device(self):
        return self._device

    def data_ptr(self):
        return self._address


class Driver:
    """Recording cuLaunchKernelEx, cuStreamIsCapturing and cuTensorMapEncodeTiled; `status` is
    what the launch returns, `encode_status` what the encoder does. An encoded map's 128 bytes are
    16 words: the address, then the rank, then 14 of its number in `encoded`."""

    def __init__(self):
        self.launches, self.capturing, self.status = [], 0, 0
        self.encoded, self.encode_status = [], 0
        self.slots = SLOTS  # a launch's 8-byte parameter slots to read back
        self.launch = LAUNCH(self._launch)
        self.is_capturing = IS_CAPTURING(self._is_capturing)
        self.encode = ENCODE(self._encode)

    def _encode(self, out, data_type, rank, address, dims, strides, box, unit, *flags):
        self.encoded.append(dict(data_type=data_type, address=address, dims=tuple(dims[:rank]),
                                 strides=tuple(strides[:rank - 1]), box=tuple(box[:rank]), unit=tuple(unit[:rank]),
                                 flags=flags, aligned=out % 64 == 0))
        words = (ctypes.c_uint64 * 16).from_address(out)
        words[:] = [address or 0, rank] + [len(self.encoded)] * 14
        return self.encode_status

    def _launch(self, config, function, params, extra):
        c = config.contents
        attributes = [(c.attrs[i].id, c.attrs[i].value[0]) for i in range(c.num_attrs)]
        self.launches.append(dict(function=function, grid=(c.grid_x, c.grid_y, c.grid_z),
                                  block=(c.block_x, c.block_y, c.block_z), smem=c.smem, stream=c.stream,
                                  attributes=attributes, extra=extra,
                                  params=[ctypes.c_uint64.from_address(params[i]).value for i in range(self.slots)]))
        return self.status

    def _is_capturing(self, stream, status):
        status[0] = self.capturing
        return 0

    def addresses(self):
        return (*(ctypes.cast(f, ctypes.c_void_p).value for f in (self.launch, self.is_capturing, self.encode)),
                MAP_FLAGS)


SLOTS = 8


class PackedLaunch:
    """A Launch's buffers: 8-byte slots and the pointer array into them."""

    def __init__(self, function, slots, dependent=False, maps=(), count=SLOTS):
        """maps: (first slot, index of the address it follows, dims, strides, box) each"""
        self.values = np.full(count, 7, np.uint64)  # 7: a slot the call leaves alone
        self.pointers = (self.values.ctypes.data + 8 * np.arange(count, dtype=np.uint64)).astype(np.uint64)
        self.mapped = np.zeros(len(maps), np.uint64)  # Launch._mapped: encoded for no address yet
        encodings = (self.mapped.ctypes.data, tuple((slot, tensor, 6, *layout) for slot, tensor, *layout in maps))
        self.entry = (function, (8, 1, 4), 128, 135168, dependent, self.pointers.ctypes.data, self.values.ctypes.data,
                      count, slots, encodings if maps else None, self)


INT32 = object()


class Prepared:
    """A HotPath as PreparedAttention builds one, for q, k, v [1, 32, 1, 128] / [1, 8, 1024, 128]
    (with `indices`, a paged call's cache_seqlens [1] and page_table [1, 16] after them)."""

    LSE = 0xE000

    def __init__(self, launches, device=0, current_device=0, indices=False, growing=None):
        self.driver = Driver()
        self.q = Tensor((1, 32, 1, 128), 0xA000)
        self.k = Tensor((1, 8, 1024, 128), 0xB000)
        self.v = Tensor((1, 8, 1024, 128), 0xC000)
        self.indices = [Tensor((1,), 0x1000, INT32), Tensor((1, 16), 0x2000, INT32)] if indices else []
        self.inputs = [self.q, self.k, self.v, *self.indices]
        self.allocated, self.captures, self.streams_asked = [], 0, []
        layout = tuple(x for t in self.inputs for x in (t.shape, t.stride()))
        dtypes = (*(t.dtype for t in self.inputs), FLOAT16)  # then out's
        self.arguments = (layout, dtypes, device, self.q.shape, self.q.stride(), self._stream_of, lambda: current_device,
                          self._allocate, self._on_capture, self.LSE, *self.driver.addresses(),
                          tuple(p.entry for p in launches))
        self.hot = hot_path.module().HotPath(*self.arguments, *(() if growing is None else (growing,)))

    def _stream_of(self, device):
        self.streams_asked.append(device)
        return STREAM

    def _allocate(self, q):
        out = Tensor(q.shape, 0xD000 + 0x100 * len(self.allocated))
        self.allocated.append(out)
        return out

    def _on_capture(self):
        self.captures += 1


@pytest.fixture(scope="module")
def module():
    built = hot_path.module()
    assert built is not None, hot_path.reason()  # CI has a C compiler and Python.h: it must build
    return built


def test_a_call_re_points_every_slot_and_launches_once(module):
    packed = PackedLaunch(0xF00, (0, 1, 2, 3, 4), dependent=True)
    p = Prepared([packed])
    out = Tensor(p.q.shape, 0xD000)
    assert p.hot.run(p.q, p.k, p.v, out) is out
    (launch,) = p.driver.launches
    assert launch["function"] == 0xF00 and launch["grid"] == (8, 1, 4) and launch["block"] == (128, 1, 1)
    assert launch["smem"] == 135168 and launch["stream"] == STREAM and launch["extra"] is None
    assert launch["params"] == [0xA000, 0xB000, 0xC000, 0xD000, Prepared.LSE, 7, 7, 7]
    assert launch["attributes"] == [(PROGRAMMATIC_STREAM_SERIALIZATION, 1)]
    assert p.streams_asked == [0] and p.captures == 0


def test_a_plain_launch_has_no_attribute_and_out_is_allocated_where_not_given(module):
    p = Prepared([PackedLaunch(0xF00, (0, 1, 2, 3, 4))])
    out = p.hot.run(p.q, p.k, p.v, None)
    assert out is p.allocated[0] and out.shape == p.q.shape
    (launch,) = p.driver.launches
    assert launch["attributes"] == [] and launch["params"][3] == out.data_ptr()


def test_the_merge_launch_takes_out_and_lse_and_the_split_kernel_the_inputs(module):
    split, merge = PackedLaunch(0xF00, (0, 1, 2, -1, -1)), PackedLaunch(0xF01, (-1, -1, -1, 1, 0))
    p = Prepared([split, merge])
    out = Tensor(p.q.shape, 0xD000)
    p.hot.run(p.q, p.k, p.v, out)
    first, second = p.driver.launches
    assert first["function"] == 0xF00 and first["params"][:4] == [0xA000, 0xB000, 0xC000, 7]
    assert second["function"] == 0xF01 and second["params"][:3] == [Prepared.LSE, 0xD000, 7]


# a map of q (rank 4) in slots 8-23 and of v (rank 5) in slots 24-39, after five address slots
Q_MAP = (8, 0, (128, 1, 32, 1), (256, 256, 8192), (64, 128, 1, 1))
V_MAP = (24, 2, (64, 1024, 2, 8, 1), (128, 128, 2 ** 18, 2 ** 21), (64, 8, 2, 1, 1))


def test_tensor_maps_are_encoded_where_their_tensors_moved(module):
    """Each map is encoded into its 16 slots, for the address it follows, with its dims, strides
    and box, every element stepped, the flags passed through, into a 64-byte-aligned map; a call
    with the same addresses encodes nothing; a moved v encodes v's map alone."""
    packed = PackedLaunch(0xF00, (0, 1, 2, 3, 4), maps=(Q_MAP, V_MAP), count=40)
    p = Prepared([packed])
    p.driver.slots = 40
    p.hot.run(p.q, p.k, p.v, Tensor(p.q.shape, 0xD000))
    first, second = p.driver.encoded
    assert first == dict(data_type=6, address=0xA000, dims=Q_MAP[2], strides=Q_MAP[3], box=Q_MAP[4], unit=(1,) * 4,
                         flags=MAP_FLAGS, aligned=True)
    assert second["address"] == 0xC000 and second["dims"] == V_MAP[2] and second["unit"] == (1,) * 5
    params = p.driver.launches[0]["params"]
    assert params[8:10] == [0xA000, 4] and params[10:24] == [1] * 14
    assert params[24:26] == [0xC000, 5] and params[26:40] == [2] * 14
    assert list(packed.mapped) == [0xA000, 0xC000]  # shared with the Python path
    p.hot.run(p.q, p.k, p.v, None)
    assert len(p.driver.encoded) == 2
    p.hot.run(p.q, p.k, Tensor(p.v.shape, 0xC100), None)
    assert [e["address"] for e in p.driver.encoded] == [0xA000, 0xC000, 0xC100]
    assert p.driver.launches[-1]["params"][24:27] == [0xC100, 5, 3] and list(packed.mapped) == [0xA000, 0xC100]


def test_a_refused_map_launches_nothing_and_says_why(module):
    tiles = PackedLaunch(0xF02, (0, -1, -1, -1, -1))
    kernel = PackedLaunch(0xF00, (0, 1, 2, 3, 4), maps=(Q_MAP,), count=24)
    p = Prepared([tiles, kernel])
    p.driver.encode_status = 1  # CUDA_ERROR_INVALID_VALUE
    with pytest.raises(ValueError, match="cuTensorMapEncodeTiled refused the tensor at 0xa000 .CUresult 1."):
        p.hot.run(p.q, p.k, p.v, None)
    assert p.driver.launches == [] and list(kernel.mapped) == [0]


@pytest.mark.parametrize("bad_map, why", [((20, 0, *Q_MAP[2:]), "128 bytes within"), ((8, 5, *Q_MAP[2:]), "addresses"),
                                          ((8, 0, (1,) * 6, (1,) * 5, (1,) * 6), "rank 1-5"),
                                          ((8, 0, Q_MAP[2], Q_MAP[3][:2], Q_MAP[4]), "strides one fewer")])
def test_a_map_outside_its_launch_is_refused(module, bad_map, why):
    with pytest.raises(ValueError, match="rank 1-5 .its strides one fewer, its box as many., its 128 bytes within"):
        Prepared([PackedLaunch(0xF00, (0, 1, 2, 3, 4), maps=(bad_map,), count=24)])


def _not_as_prepared(p):
    """(what differs, q, k, v, out): each a call the hot path must hand back"""
    q, k, v = p.q, p.k, p.v
    out = Tensor(q.shape, 0xD000)
    return [
        ("q's shape", Tensor((1, 32, 2, 128), 0xA000), k, v, out),
        ("k's strides", q, Tensor(k.shape, 0xB000, stride=(2 ** 20, 128, 1024, 1)), v, out),
        ("v's dtype", q, k, Tensor(v.shape, 0xC000, dtype=object()), out),
        ("v's device", q, k, Tensor(v.shape, 0xC000, device=1), out),
        ("out's shape", q, k, v, Tensor((1, 32, 1, 64), 0xD000)),
        ("out's strides", q, k, v, Tensor(q.shape, 0xD000, stride=(4096, 1, 4096, 32))),
        ("out's dtype", q, k, v, Tensor(q.shape, 0xD000, dtype=object())),
        ("not a tensor", q, k, object(), out),
    ]


@pytest.mark.parametrize("case", range(8))
def test_tensors_not_as_prepared_are_handed_back_unlaunched(module, case):
    p = Prepared([PackedLaunch(0xF00, (0, 1, 2, 3, 4))])
    what, q, k, v, out = _not_as_prepared(p)[case]
    assert p.hot.run(q, k, v, out) is NotImplemented, what
    assert p.driver.launches == [] and p.allocated == []


class _NoStrides(Tensor):
    """A contiguous tensor whose strides may not be read: the hot path asks is_contiguous() instead."""

    def stride(self):
        raise AssertionError("stride() read for a contiguous input")


def test_a_contiguous_input_s_strides_over_dimensions_of_one_are_not_compared(module):
    """An input prepared contiguous takes a tensor of its shape that is contiguous, whatever its
    strides over dimensions of one (never stepped), without reading its strides; one prepared with
    other strides takes exactly those."""
    p = Prepared([PackedLaunch(0xF00, (0, 1, 2, 3, 4))])
    q = _NoStrides(p.q.shape, 0xA100, stride=(999, 128, 5, 1))
    out = Tensor(p.q.shape, 0xD000)
    assert p.hot.run(q, p.k, p.v, out) is out and len(p.driver.launches) == 1
    transposed = Tensor(p.q.shape, 0xA100, stride=(4096, 1, 4096, 32))  # (of the shape, not contiguous)
    assert p.hot.run(transposed, p.k, p.v, out) is NotImplemented
    given = _NoStrides(p.q.shape, 0xD100, stride=(5, 128, 3, 1))  # out, likewise (empty_like of such a q)
    assert p.hot.run(p.q, p.k, p.v, given) is given and len(p.driver.launches) == 2
    strided = Prepared([PackedLaunch(0xF00, (0, 1, 2, 3, 4))])
    strided.k = Tensor(p.k.shape, 0xB000, stride=(2 ** 20, 256, 2048, 1))  # every other row of a wider cache
    layout = tuple(x for t in (strided.q, strided.k, strided.v) for x in (t.shape, t.stride()))
    hot = module.HotPath(layout, *strided.arguments[1:])
    assert hot.run(strided.q, strided.k, strided.v, out) is out
    assert hot.run(strided.q, p.k, strided.v, out) is NotImplemented  # contiguous, not as prepared


def test_another_current_device_is_handed_back(module):
    p = Prepared([PackedLaunch(0xF00, (0, 1, 2, 3, 4))], current_device=1)
    assert p.hot.run(p.q, p.k, p.v, None) is NotImplemented and p.driver.launches == []


def test_the_first_call_under_capture_keeps_the_owner_once(module):
    p = Prepared([PackedLaunch(0xF00, (0, 1, 2, 3, 4))])
    p.hot.run(p.q, p.k, p.v, None)
    assert p.captures == 0
    p.driver.capturing = 1  # cudaStreamCaptureStatusActive
    p.hot.run(p.q, p.k, p.v, None)
    p.hot.run(p.q, p.k, p.v, None)
    assert p.captures == 1 and len(p.driver.launches) == 3


def test_a_failed_launch_raises_with_the_driver_s_code(module):
    p = Prepared([PackedLaunch(0xF00, (0, 1, 2, 3, 4))])
    p.driver.status = 700
    with pytest.raises(RuntimeError, match="cuLaunchKernelEx failed: CUresult 700"):
        p.hot.run(p.q, p.k, p.v, None)


def test_a_launch_needs_a_slot_for_every_address(module):
    with pytest.raises(ValueError, match="slots are the inputs', out's and lse's"):
        Prepared([PackedLaunch(0xF00, (0, 1, 2))])


def test_a_paged_call_re_points_its_index_tensors_and_checks_their_dtype(module):
    """q, k_cache, v_cache, cache_seqlens, page_table, out, lse: seven addresses"""
    p = Prepared([PackedLaunch(0xF00, (0, 1, 2, 5, 6, 3, 4))], indices=True)
    out = Tensor(p.q.shape, 0xD000)
    assert p.hot.run(*p.inputs, out) is out
    assert p.driver.launches[0]["params"] == [0xA000, 0xB000, 0xC000, 0xD000, Prepared.LSE, 0x1000, 0x2000, 7]
    wrong = Tensor((1, 16), 0x2000, FLOAT16)  # page_table of another dtype
    assert p.hot.run(p.q, p.k, p.v, p.indices[0], wrong, out) is NotImplemented and len(p.driver.launches) == 1
    assert p.hot.run(p.q, p.k, p.v, out) is NotImplemented and len(p.driver.launches) == 1  # too few


def test_a_varlen_call_numbers_its_tiles_from_cu_seqlens_q_before_the_kernel_and_the_merge(module):
    """A varlen batch's three launches in order: the tile table's (its one slot: the index tensor
    after q, k, v), the split kernel's (the inputs), the merge's (out, lse)."""
    tiles = PackedLaunch(0xF02, (-1, -1, -1, 0, -1, -1, -1))
    split = PackedLaunch(0xF00, (0, 1, 2, 3, 4, -1, -1))
    merge = PackedLaunch(0xF01, (-1, -1, -1, -1, -1, 0, 1))
    p = Prepared([tiles, split, merge], indices=True)
    out = Tensor(p.q.shape, 0xD000)
    assert p.hot.run(*p.inputs, out) is out
    assert [launch["function"] for launch in p.driver.launches] == [0xF02, 0xF00, 0xF01]
    first, second, third = (launch["params"] for launch in p.driver.launches)
    assert first == [0x1000, 7, 7, 7, 7, 7, 7, 7]
    assert second[:5] == [0xA000, 0xB000, 0xC000, 0x1000, 0x2000] and third[:2] == [0xD000, Prepared.LSE]


def test_at_most_three_launches(module):
    with pytest.raises(ValueError, match="1-3 launches"):
        Prepared([PackedLaunch(0xF00 + i, (0, 1, 2, 3, 4)) for i in range(4)])


def test_a_build_that_fails_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    with pytest.raises(RuntimeError, match="false failed on hot_path.c"):
        hot_path.build(tmp_path / "hot.so")
    assert not list(tmp_path.iterdir())  # no partial library left behind


def test_a_module_that_cannot_be_built_warns_once_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("FAGEN_CACHE_DIR", str(tmp_path))  # nothing built here yet
    hot_path.module.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="Python path.*false failed on hot_path.c"):
            assert hot_path.module() is None
        assert hot_path.module() is None  # cached: no second build, no second warning
        assert "false failed" in hot_path.reason()
    finally:
        hot_path.module.cache_clear()


def test_a_slot_past_the_launch_s_buffer_is_refused(module):
    with pytest.raises(ValueError, match="slot 8 outside the launch's 8"):
        Prepared([PackedLaunch(0xF00, (0, 1, 2, 3, 8))])


def test_an_object_whose_init_failed_does_not_launch(module):
    p = Prepared([PackedLaunch(0xF00, (0, 1, 2, 3, 4))])
    bare = module.HotPath.__new__(module.HotPath)
    with pytest.raises(RuntimeError, match="not initialised"):
        bare.run(p.q, p.k, p.v, None)
    half = module.HotPath.__new__(module.HotPath)
    good, bad = PackedLaunch(0xF00, (0, 1, 2, 3, 4)), PackedLaunch(0xF01, (0, 1, 2, 3, 99))
    with pytest.raises(ValueError):
        half.__init__(*p.arguments[:-1], (good.entry, bad.entry))
    with pytest.raises(RuntimeError, match="not initialised"):
        half.run(p.q, p.k, p.v, None)
    assert p.driver.launches == []


def test_misaligned_inputs_or_out_are_handed_back_unlaunched(module):
    """q, k, v and out are read and written 16 bytes at a time: a view whose address is not a
    multiple of 16 (its strides as prepared) goes back to the Python path, nothing allocated."""
    p = Prepared([PackedLaunch(0xF00, (0, 1, 2, 3, 4))])
    shifted = Tensor(p.k.shape, 0xB002)
    assert p.hot.run(p.q, shifted, p.v, None) is NotImplemented and p.allocated == []
    assert p.hot.run(p.q, p.k, p.v, Tensor(p.q.shape, 0xD008)) is NotImplemented
    assert p.driver.launches == []


def test_a_hot_path_takes_q_k_and_v_at_least(module):
    p = Prepared([PackedLaunch(0xF00, (0, 1, 2, 3, 4))])
    layout, dtypes = p.arguments[0], p.arguments[1]
    with pytest.raises(ValueError, match="3-8 inputs"):
        module.HotPath(layout[:4], (*dtypes[:2], dtypes[-1]), *p.arguments[2:-1], (PackedLaunch(0xF00, (0, 1, 2, 3)).entry,))


# A growing class's kernel (fagen.decode.GrowingKeys): q, k, v, out and lse in slots 0-4, then the
# fields each call writes, as Launch.param_slots gives them: n_kv and mask_offset (int), the six
# K/V strides (long long), the split share (int)
GROWING_PARAMS = {"n_kv": (5, "int"), "mask_offset": (6, "int"), "k_sb": (7, "long long"), "k_sh": (8, "long long"),
                  "k_sn": (9, "long long"), "v_sb": (10, "long long"), "v_sh": (11, "long long"),
                  "v_sn": (12, "long long"), "kv_tiles_per_split": (13, "int")}
GROWING_SLOTS = 16


def _growing(bottom_right=True, splits=4, chunk=8):
    """A HotPath of a growing class over keys [1024, 2048) in 64-key tiles, K and V copied `chunk`
    elements at a time (16 bytes: 8 of a half type, 16 of an FP8 cache), and its kernel's launch."""
    fields = tuple((slot, 8 if ctype == "long long" else 4) for slot, ctype in GROWING_PARAMS.values())
    packed = PackedLaunch(0xF00, (0, 1, 2, 3, 4), count=GROWING_SLOTS)
    p = Prepared([packed], growing=(1024, 2048, 64, splits, 1, bottom_right, chunk, (1, 8, 128), (1, 8, 128), fields))
    p.driver.slots = GROWING_SLOTS
    return p, packed


def _cache_view(length, rows=4096, address=0xB000):
    """k or v: the first `length` rows of a [1, 8, rows, 128] cache (a generation loop's growing view)."""
    return Tensor((1, 8, length, 128), address, stride=(8 * rows * 128, rows * 128, 128, 1))


@pytest.mark.parametrize("length, rows, bottom_right", [(1500, 4096, True), (1024, 1024, True), (2047, 2048, False)])
def test_a_growing_class_writes_its_fields_as_the_python_writer_does(module, length, rows, bottom_right):
    from fagen.runtime import scalar_writer

    p, packed = _growing(bottom_right)
    k, v = _cache_view(length, rows), _cache_view(length, rows, 0xC000)
    out = p.hot.run(p.q, k, v, None)
    assert out is p.allocated[0]
    (launch,) = p.driver.launches
    expected = np.full(GROWING_SLOTS, 7, np.uint64)
    expected[:5] = [0xA000, 0xB000, 0xC000, out.data_ptr(), Prepared.LSE]
    share = -(-(-(-length // 64)) // 4)
    scalar_writer(expected, GROWING_PARAMS, tuple(GROWING_PARAMS))(length, length - 1 if bottom_right else 0,
                                                                   *k.stride()[:3], *v.stride()[:3], share)
    assert launch["params"] == expected.tolist()


def test_a_growing_class_without_splits_writes_no_share(module):
    fields = tuple((slot, 8 if ctype == "long long" else 4) for slot, ctype in list(GROWING_PARAMS.values())[:8])
    packed = PackedLaunch(0xF00, (0, 1, 2, 3, 4), count=GROWING_SLOTS)
    p = Prepared([packed], growing=(1024, 2048, 64, 1, 1, True, 8, (1, 8, 128), (1, 8, 128), fields))
    p.driver.slots = GROWING_SLOTS
    p.hot.run(p.q, _cache_view(1100), _cache_view(1100, address=0xC000), None)
    assert p.driver.launches[0]["params"][5:14] == [1100, 1099, *_cache_view(1100).stride()[:3],
                                                    *_cache_view(1100).stride()[:3], 7]


def _outside_the_class(p):
    k, v = _cache_view(1500), _cache_view(1500, address=0xC000)
    return [
        ("k as long as the class's end", _cache_view(2048), _cache_view(2048, address=0xC000)),
        ("k shorter than the class", _cache_view(1023), _cache_view(1023, address=0xC000)),
        ("v shorter than k", k, _cache_view(1499, address=0xC000)),
        ("a row stride off 16 bytes", Tensor((1, 8, 1500, 128), 0xB000, stride=(8 * 4096 * 130, 4096 * 130, 130, 1)), v),
        ("a last stride of 2", Tensor((1, 8, 1500, 128), 0xB000, stride=(8 * 4096 * 256, 4096 * 256, 256, 2)), v),
        ("other heads", Tensor((1, 4, 1500, 128), 0xB000, stride=(4 * 4096 * 128, 4096 * 128, 128, 1)), v),
        ("another head_dim", k, Tensor((1, 8, 1500, 64), 0xC000, stride=(8 * 4096 * 64, 4096 * 64, 64, 1))),
        ("another dtype", k, Tensor((1, 8, 1500, 128), 0xC000, INT32, stride=v.stride())),
        ("another device", Tensor((1, 8, 1500, 128), 0xB000, device=1, stride=k.stride()), v),
        ("rank 3", Tensor((8, 1500, 128), 0xB000), v),
    ]


@pytest.mark.parametrize("case", range(10))
def test_a_growing_class_hands_back_what_is_outside_it_unwritten(module, case):
    p, packed = _growing()
    what, k, v = _outside_the_class(p)[case]
    assert p.hot.run(p.q, k, v, None) is NotImplemented, what
    assert p.driver.launches == [] and p.allocated == [] and (packed.values == 7).all(), what


@pytest.mark.parametrize("row_stride, taken", [(136, False), (144, True)])
def test_an_fp8_cache_s_class_takes_rows_of_whole_16_byte_chunks(module, row_stride, taken):
    """An FP8 cache's K and V rows are copied 16 values at a time: a row stride of 136 elements
    (8 bytes off 16) would make the kernel's copies misaligned, so the class hands it back."""
    p, packed = _growing(chunk=16)
    k, v = (Tensor((1, 8, 1500, 128), address, stride=(8 * 4096 * row_stride, 4096 * row_stride, row_stride, 1))
            for address in (0xB000, 0xC000))
    out = p.hot.run(p.q, k, v, None)
    assert (out is not NotImplemented) == taken and len(p.driver.launches) == taken


def test_a_growing_class_s_copies_are_16_bytes_of_a_half_type_or_fp8(module):
    with pytest.raises(ValueError, match="chunks of 8 or 16 elements"):
        _growing(chunk=4)


def test_a_growing_class_s_fields_must_fit_the_launch(module):
    with pytest.raises(ValueError, match="slot 16"):
        Prepared([PackedLaunch(0xF00, (0, 1, 2, 3, 4), count=GROWING_SLOTS)],
                 growing=(1024, 2048, 64, 4, 1, True, 8, (1, 8, 128), (1, 8, 128), ((16, 4),) * 9))
