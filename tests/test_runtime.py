"""fagen.runtime without a GPU: arguments packed by name from the plan's parameter table, and
the shipped default each GPU gets."""

import numpy as np
import pytest

import fagen
from fagen import device, dispatch, runtime
from fagen.load import SPECS
from fagen.plan import TMA_MAP, merge_plan, plan
from fagen.runtime import pack_arguments, packers


def values_for(params) -> dict:
    return {name: bytes([i + 1]) * 128 if ctype == TMA_MAP else i + 1 for i, (ctype, name) in enumerate(params)}


@pytest.mark.parametrize("name", ["attn_f16_d128", "omni_prefetch_f16_d128", "document_causal_f16_d128",
                                  "bias_matrix_f16_d64", "causal_softcap_sinks_f16_d128", "attn_f16_d128_h200"])
def test_arguments_follow_the_signature_by_name(name):
    p = plan(fagen.load_spec(SPECS / f"{name}.yaml"))
    values = values_for(p.params)
    args = pack_arguments(packers(p.params), dict(reversed(values.items())))  # order of the dict does not matter
    assert [a if isinstance(a, (bytes, np.floating)) else int(a) for a in args] == list(values.values())
    for (ctype, _), arg in zip(p.params, args):
        expected = np.uint64 if "*" in ctype else runtime.C_SCALARS[ctype]
        assert type(arg) is expected, (ctype, type(arg))


def test_a_missing_argument_is_named():
    p = plan(fagen.load_spec(SPECS / "document_causal_f16_d128.yaml"))
    values = values_for(p.params)
    del values["doc_bounds"]
    with pytest.raises(ValueError, match="doc_bounds"):
        pack_arguments(packers(p.params), values)


def test_the_merge_kernel_packs_from_its_plan():
    from fagen.plan import merge_warps

    m = merge_plan("float16")
    assert [merge_warps(s) for s in (1, 2, 7, 8, 9, 64)] == [1, 2, 7, 8, 8, 8]  # a warp a split, a block a row
    assert m.max_warps == 8 and m.splits_in_flight * m.max_warps == 32  # 32 splits in one round trip
    assert len(pack_arguments(packers(m.params), values_for(m.params))) == len(m.params)


@pytest.mark.parametrize(("gpu", "expected"), [("h200", "attn_bf16_d64_causal_h200"), ("h100", "attn_bf16_d64_causal_h200"),
                                               ("a100", "attn_bf16_d64_causal"), (None, "attn_bf16_d64_causal")])
def test_each_gpu_gets_its_tuned_default(monkeypatch, gpu, expected):
    monkeypatch.setattr(device, "gpu_slug", lambda: gpu)
    assert dispatch.default_spec("bfloat16", 64, True).name == expected


def test_launch_slots_hold_each_parameter_in_its_c_type():
    """A Launch's buffer: one 8-byte slot a parameter, read by the driver from the slot's start."""
    import struct

    from fagen.runtime import slot_format

    params = (("const elem_t* __restrict__", "q"), ("int", "n"), ("long long", "stride"), ("float", "scale"),
              ("unsigned", "flags"))
    fmt = slot_format(params)
    assert struct.calcsize(fmt) == 8 * len(params)
    buffer = struct.pack(fmt, 2**40 + 16, -7, -(2**40), 0.125, 2**31)
    slots = [buffer[8 * i:8 * i + 8] for i in range(len(params))]
    assert struct.unpack("<Q", slots[0])[0] == 2**40 + 16 and struct.unpack("<i", slots[1][:4])[0] == -7
    assert struct.unpack("<q", slots[2])[0] == -(2**40) and struct.unpack("<f", slots[3][:4])[0] == 0.125
    assert struct.unpack("<I", slots[4][:4])[0] == 2**31


def test_a_scalar_writer_rewrites_named_parameters_in_adjacent_runs():
    """GrowingKeys' per-call rewrite: the named parameters land in their slots in their C types,
    nothing else changes, and parameters in adjacent slots pack as one store."""
    import struct

    from fagen.runtime import scalar_writer, slot_format, slot_offsets

    params = (("const elem_t* __restrict__", "k"), ("int", "n_q"), ("int", "n_kv"), ("int", "mask_offset"),
              ("long long", "k_sb"), ("long long", "k_sh"), ("float", "scale_log2"), ("int", "kv_tiles_per_split"))
    offsets, total = slot_offsets(params)
    buffer = np.zeros(total, np.uint64)
    struct.pack_into(slot_format(params), buffer, 0, 2**40, 1, 100, 99, 8, 16, 0.5, 3)
    write = scalar_writer(buffer, {name: (at, ctype) for at, (ctype, name) in zip(offsets, params)},
                          ("n_kv", "mask_offset", "k_sb", "k_sh", "kv_tiles_per_split"))
    assert write.stores == 2  # n_kv .. k_sh adjacent; the split share after scale_log2
    write(4097, -3, 2**33, 2**20, 7)
    assert struct.unpack(slot_format(params), buffer.tobytes()) == (2**40, 1, 4097, -3, 2**33, 2**20, 0.5, 7)


def test_repeated_calls_key_only_the_calls_a_kept_launch_can_serve():
    """A plain kernel keys calls without a given LSE or splits; a split-KV or accumulating one
    only calls that give their out and lse (what its launch writes) for one split. What the
    checks read is in the key: another diagonal or layout is another key."""
    from fagen.runtime import RepeatedCalls

    q, k, v = (np.zeros(shape, np.float16) for shape in ((1, 4, 64, 32), (1, 2, 96, 32), (1, 2, 96, 32)))
    out, lse = np.zeros((1, 4, 64, 32), np.float32), np.zeros((1, 4, 64), np.float32)
    plain, given = RepeatedCalls(writes_given=False), RepeatedCalls(writes_given=True)
    assert plain.key(q, k, v, None, None, None, False, None, None) is not None
    assert plain.key(q, k, v, None, lse, None, False, None, None) is None
    assert plain.key(q, k, v, None, None, None, False, None, 2) is None
    assert given.key(q, k, v, None, lse, None, False, None, None) is None
    assert given.key(q, k, v, out, lse, None, False, None, 2) is None
    key = given.key(q, k, v, out, lse, None, False, 0, None)
    assert key is not None and key == given.key(q.copy(), k, v, out, lse, None, False, 0, None)
    assert key != given.key(q, k, v, out, lse, None, False, -64, None)
    assert key != given.key(np.zeros((1, 64, 4, 32), np.float16).transpose(0, 2, 1, 3), k, v, out, lse, None, False,
                            0, None)


def test_launch_repoints_its_slots_and_launches_once(monkeypatch):
    """A call stores the addresses in the slots named at packing (one struct store when they are
    the first parameters, as the forward's q, k, v, o, lse are) and makes one driver launch."""
    from types import SimpleNamespace

    from fagen.runtime import Launch

    launched = []
    fake = SimpleNamespace(cuda=SimpleNamespace(driver=SimpleNamespace(launchKernel=lambda *a: launched.append(a))))
    monkeypatch.setattr(runtime, "cupy", fake)
    params = (("const elem_t* __restrict__", "q"), ("const elem_t* __restrict__", "k"), ("int", "n"),
              ("float", "scale"))
    launch = Launch(SimpleNamespace(ptr=77), (3, 2, 1), 128, 4096, params, dict(q=1, k=2, n=5, scale=0.5),
                    slots=("q", "k"))
    launch(9, 1000, 2000)
    assert launch.values[:2].tolist() == [1000, 2000] and int(launch.values[2]) & 0xffffffff == 5
    launch(9, 3000)  # the first slot only
    assert launch.values[:2].tolist() == [3000, 2000]
    assert len(launched) == 2 and launched[0][:8] == (77, 3, 2, 1, 128, 1, 1, 4096) and launched[0][8] == 9
    out_of_order = Launch(SimpleNamespace(ptr=77), (1, 1, 1), 32, 0, params, dict(q=1, k=2, n=5, scale=0.5),
                          slots=("k", "q"))
    out_of_order(0, 10, 20)
    assert out_of_order.values[:2].tolist() == [20, 10]
