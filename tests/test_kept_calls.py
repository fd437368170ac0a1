"""The kept classes of unvalidated calls (sequences.KeptCalls), without a GPU: the first call of a
layout prepares a class, a call of the same layout and options launches through it, anything
else prepares its own or is handed to the general path; the last call's class is tried first.
Tensors and prepared calls are stand-ins recording what they are asked."""

import sys
from types import SimpleNamespace

import numpy as np
import pytest

from fagen import sequences


class _Torchish:
    """What KeptPagedCalls reads of a CUDA tensor, without one."""

    def __init__(self, *shape, dtype="float16", at=4096):
        self.shape, self.dtype, self.at = shape, dtype, at

    def stride(self):
        return tuple(int(np.prod(self.shape[i + 1:])) for i in range(len(self.shape)))

    def get_device(self):
        return 0

    def data_ptr(self):
        return self.at


def _options(**given) -> tuple:
    """A kept call's options as the API functions pass them (sequences.KEPT_OPTIONS' order)."""
    named = {**dict(causal=False, mask=None, softcap=None, scale=None, sinks=None), **given}
    return tuple(named[name] for name in sequences.KEPT_OPTIONS)


def _prepared_fake(made: list, answer: str):
    """A PreparedKVCache stand-in recording itself in `made`, with a C path (`_hot`) that launches
    (counting calls, answering `answer`) where the tensors' layouts are the prepared ones."""
    class Prepared:
        def __init__(self, *tensors, **options):
            self.layout, self.calls = [(t.shape, t.stride(), t.dtype) for t in tensors], 0
            self._held = []  # (a prepared call's memory its launches read: a kept call adds what its key names)
            made.append(self)
            prepared = self

            class Hot:
                def run(self, *given):
                    if [(t.shape, t.stride(), t.dtype) for t in given[:-1]] != prepared.layout:
                        return NotImplemented
                    prepared.calls += 1
                    return answer
            self._hot = Hot()
    return Prepared


def test_paged_calls_without_validation_are_packed_once_a_layout(monkeypatch):
    """attention_with_kvcache(validate=False)'s serving loop: the first call of a layout packs a
    PreparedKVCache (without reading the page table back), a call with the same layout and options
    launches through it; another layout, option, status or stream packs its own; a given out, or
    what packing refuses, is the general path's (NotImplemented)."""
    made = []

    class Prepared(_prepared_fake(made, "out")):
        def __init__(self, *tensors, status=None, validate=True, **options):
            if options["softcap"] == -1.0:
                raise ValueError("refused by name")
            assert validate is False
            super().__init__(*tensors)

        def __call__(self, *tensors, return_lse=False):
            self.calls += 1
            return "out"

    monkeypatch.setattr(sequences, "PreparedKVCache", Prepared)
    current = [0]
    monkeypatch.setattr(sequences, "cupy", SimpleNamespace(cuda=SimpleNamespace(
        runtime=SimpleNamespace(getDevice=lambda: current[0]))))
    kept = sequences.KeptPagedCalls()
    streams = iter([7] * 6 + [8] + [8] * 2)
    capturing = [False]
    kept._stream, kept._capturing = (lambda device: next(streams)), (lambda: capturing[0])
    q, cache = _Torchish(4, 32, 1, 128), _Torchish(256, 16, 8, 128)
    lengths, table = _Torchish(4, dtype="int32"), _Torchish(4, 64, dtype="int32")
    options = dict(causal=True, mask=None, softcap=None, scale=None, sinks=None)
    call = lambda *tensors, status=None, out=None, **o: kept(*tensors, status, out, False, _options(**{**options, **o}))
    assert call(q, cache, cache, lengths, table) == "out" and len(made) == 1
    assert call(q, _Torchish(256, 16, 8, 128, at=8192), cache, _Torchish(4, dtype="int32", at=0), table) == "out"
    assert len(made) == 1 and made[0].calls == 2  # other addresses, the same class
    assert call(q, cache, cache, lengths, _Torchish(4, 32, dtype="int32")) == "out" and len(made) == 2  # another layout
    assert call(q, cache, cache, lengths, table, causal=False) == "out" and len(made) == 3
    assert call(q, cache, cache, lengths, table, status=_Torchish(1, dtype="int32")) == "out" and len(made) == 4
    assert call(q, cache, cache, lengths, table, out=q) is NotImplemented and len(made) == 4
    assert call(q, cache, cache, lengths, table, softcap=-1.0) is NotImplemented
    assert call(q, cache, cache, lengths, table) == "out" and len(made) == 5  # stream 8: its own class
    # a status of another layout at the same address: its own class (the packing checks it)
    assert call(q, cache, cache, lengths, table, status=_Torchish(1, dtype="int64")) == "out" and len(made) == 6
    current[0] = 1  # another GPU current: the general path's, which switches to q's
    assert call(q, cache, cache, lengths, table) is NotImplemented
    current[0], capturing[0] = 0, True  # a graph being captured: the general path's
    assert call(q, cache, cache, lengths, table) is NotImplemented and len(made) == 6


def test_a_serving_loop_s_repeated_paged_call_skips_the_key(monkeypatch):
    """The last call's class is tried first where the options are the same objects: its C path
    checks the tensors; another layout declines there and the whole key takes over. A mask given
    as a mapping (which may change in place) and a sinks tensor updated in place are never taken
    from the memo."""
    made, keys = [], []

    class Prepared(_prepared_fake(made, "hot")):
        def __call__(self, *tensors, return_lse=False):
            return "packed"

    class Kept(sequences.KeptPagedCalls):
        def __init__(self):
            super().__init__()
            self._kept = KeyLog()

    class KeyLog(dict):
        def get(self, key, default=None):
            keys.append(key)
            return super().get(key, default)

    monkeypatch.setattr(sequences, "PreparedKVCache", Prepared)
    monkeypatch.setattr(sequences, "cupy", SimpleNamespace(cuda=SimpleNamespace(
        runtime=SimpleNamespace(getDevice=lambda: 0))))
    kept = Kept()
    kept._stream, kept._capturing = (lambda device: 7), (lambda: False)
    q, cache = _Torchish(4, 32, 1, 128), _Torchish(256, 16, 8, 128)
    lengths, table = _Torchish(4, dtype="int32"), _Torchish(4, 64, dtype="int32")
    options = _options(causal=True)
    assert kept(q, cache, cache, lengths, table, None, None, False, options) == "packed" and len(keys) == 1
    assert kept(q, cache, cache, lengths, table, None, None, False, _options(causal=True)) == "hot" and len(keys) == 1
    other = _Torchish(4, 32, dtype="int32")  # another table width: the C path declines, the key decides
    assert kept(q, cache, cache, lengths, other, None, None, False, options) == "packed" and len(keys) == 2
    assert kept(q, cache, cache, lengths, other, None, None, False, options) == "hot" and len(keys) == 2
    windowed = _options(causal=True, mask={"kind": "sliding_window", "window_left": 8})
    kept(q, cache, cache, lengths, other, None, None, False, windowed)
    kept(q, cache, cache, lengths, other, None, None, False, windowed)
    assert len(keys) == 4  # a mapping mask: the whole key every call


def _kept_over_stand_ins(monkeypatch, kind, prepared):
    """A `kind` (KeptVarlenCalls or KeptPagedCalls) over stand-ins: `prepared` in place of the class
    it makes, _Torchish taken for torch's tensors, GPU 0 current, stream 7, no graph captured."""
    monkeypatch.setattr(sequences, "PreparedVarlen" if kind is sequences.KeptVarlenCalls else "PreparedKVCache",
                        prepared)
    monkeypatch.setattr(sequences, "is_torch", lambda x: isinstance(x, _Torchish))
    monkeypatch.setattr(sequences, "cupy", SimpleNamespace(cuda=SimpleNamespace(
        runtime=SimpleNamespace(getDevice=lambda: 0))))
    kept = kind()
    kept._stream, kept._capturing = (lambda device: 7), (lambda: False)
    return kept


def test_varlen_calls_without_validation_are_prepared_once_a_layout_and_max_seqlen_pair(monkeypatch):
    """attention_varlen(validate=False): a PreparedVarlen a layout (totals included) and max_seqlen
    pair, the last one's C path first; seqused_k makes a layout of its own; what preparing refuses,
    and a given out, are the general path's."""
    made = []

    class Prepared(_prepared_fake(made, "hot")):
        def __init__(self, q, k, v, cu_q, cu_k, max_q, max_k, *, seqused_k=None, validate=True, **options):
            assert validate is False
            if options["softcap"] == -1.0:
                raise ValueError("refused by name")
            self.max_seqlens = (max_q, max_k)
            super().__init__(q, k, v, cu_q, cu_k, *(() if seqused_k is None else (seqused_k,)))

        def __call__(self, *tensors, return_lse=False):
            self.calls += 1
            return "packed"

    kept = _kept_over_stand_ins(monkeypatch, sequences.KeptVarlenCalls, Prepared)
    q, k = _Torchish(3000, 32, 128), _Torchish(3000, 8, 128)
    cu = _Torchish(5, dtype="int32")
    options = dict(causal=True, mask=None, softcap=None, scale=None, sinks=None)
    call = lambda q=q, k=k, used=None, maxes=(1024, 1024), out=None, **o: kept(  # noqa: E731
        q, k, k, cu, cu, used, *maxes, out, False, _options(**{**options, **o}))
    assert call() == "packed" and len(made) == 1 and made[0].max_seqlens == (1024, 1024)
    assert call() == "hot" and call(k=_Torchish(3000, 8, 128, at=8192)) == "hot" and len(made) == 1
    assert call(maxes=(2048, 1024)) == "packed" and len(made) == 2 and made[1].max_seqlens == (2048, 1024)
    assert call(q=_Torchish(3001, 32, 128)) == "packed" and len(made) == 3  # another total_q: its own class
    assert call(used=_Torchish(4, dtype="int32")) == "packed" and len(made) == 4 and len(made[3].layout) == 6
    assert call(out=q) is NotImplemented and call(softcap=-1.0) is NotImplemented and len(made) == 4
    # FP8 q, k, v: the FP8 forward's (it makes V^T), never a class of their own
    assert call(q=_Torchish(3000, 32, 128, dtype="float8_e4m3fn")) is NotImplemented and len(made) == 4
    assert call() == "packed" and made[0].calls == 4  # the first class, found by its key


def _fp8_paged_calls(monkeypatch, prepared):
    """KeptPagedCalls over stand-ins (`prepared` for PreparedKVCache) on an e4m3 cache, B 4: a call
    taking the descales, then the tensors and options it passes."""
    kept = _kept_over_stand_ins(monkeypatch, sequences.KeptPagedCalls, prepared)
    q, cache = _Torchish(4, 32, 1, 128), _Torchish(256, 16, 8, 128, dtype="float8_e4m3fn")
    lengths, table = _Torchish(4, dtype="int32"), _Torchish(4, 64, dtype="int32")
    options = _options()
    call = lambda *descales: kept(q, cache, cache, lengths, table, None, None, False, options, descales)
    return call, q, cache, lengths, table, options, kept


def test_an_fp8_cache_s_descales_key_its_paged_class_and_are_held(monkeypatch):
    """An FP8 cache's descales are in a kept paged class's key (a number by value, a tensor by
    address, layout and version) and reach its packing; the class holds the tensors it keys by
    address, so that no later tensor takes one and finds it with a stale copy."""
    made = []

    class Prepared(_prepared_fake(made, "out")):
        def __init__(self, *tensors, status=None, validate=True, **options):
            super().__init__(*tensors)
            self.descales = tuple(options[name] for name in ("q_descale", "k_descale", "v_descale"))

        def __call__(self, *tensors, return_lse=False):
            self.calls += 1
            return "out"

    call, q, cache, lengths, table, options, kept = _fp8_paged_calls(monkeypatch, Prepared)
    k_descale = _Torchish(4, 8, dtype="float32", at=1 << 20)
    k_descale._version = 0
    assert call(None, k_descale, 0.5) == "out" and call(None, k_descale, 0.5) == "out" and len(made) == 1
    assert made[0].descales == (None, k_descale, 0.5) and k_descale in made[0]._held and made[0].calls == 2
    assert call(None, k_descale, 0.25) == "out" and len(made) == 2  # another number
    k_descale._version += 1  # written in place: the packing copied its values
    assert call(None, k_descale, 0.25) == "out" and len(made) == 3
    assert call(2.0, k_descale, 0.25) == "out" and len(made) == 4  # an FP8 q's descale too
    assert kept(q, cache, cache, lengths, table, None, None, False, options, (None, np.ones(1), None)) \
        is NotImplemented  # a descale neither a number nor a torch tensor: the general path's


class _Float32:
    def __str__(self):
        return "torch.float32"


FLOAT32 = _Float32()  # (one object, as torch's dtypes are)


class _Descale(_Torchish):
    """A float32 descale tensor on GPU 0 as fp8_inputs.kept_form reads one (its type's module is torch's)."""

    __module__ = "torch.stand_in"

    def __init__(self, at, *shape):
        super().__init__(*(shape or (4, 8)), at=at)
        self.dtype, self._version = FLOAT32, 0


def test_float32_descales_are_re_pointed_each_paged_call(monkeypatch):
    """A kept paged class takes float32 descales on q's GPU as tensors it re-points each call
    (after the page table), keyed by layout: a fresh tensor a call (a dynamic scale) or a write in
    place keeps the class, and the call hands the class its own; which descales are given, and
    their layouts, still key the class; numbers stay values."""
    made, calls = [], []

    class Prepared(_prepared_fake(made, "out")):
        def __init__(self, *tensors, status=None, validate=True, **options):
            super().__init__(*tensors)
            self.moving = options["moving_descales"]

        def __call__(self, *tensors, return_lse=False):
            calls.append(tensors[5:])
            return "out"

    call = _fp8_paged_calls(monkeypatch, Prepared)[0]
    for n in range(3):  # fresh tensors each call
        kd, vd = _Descale(1 << (20 + 2 * n)), _Descale(1 << (21 + 2 * n))
        kd._version = n
        assert call(None, kd, vd) == "out" and len(made) == 1 and calls[-1] == (kd, vd)
    assert made[0].moving == ("k_descale", "v_descale") and not any(isinstance(x, _Descale) for x in made[0]._held)
    assert call(None, kd, 0.5) == "out" and len(made) == 2 and made[1].moving == ("k_descale",)
    assert call(None, None, kd) == "out" and len(made) == 3  # the other descale given: its own class
    assert call(None, kd, _Descale(1 << 30, 1)) == "out" and len(made) == 4  # another layout
    assert call(None, kd, vd) == "out" and len(made) == 4 and calls[-1] == (kd, vd)  # the first class again


def test_a_half_type_cache_s_descales_are_refused_after_a_kept_class_too(monkeypatch):
    """attention_with_kvcache tries the last call's class before its argument checks: descales on
    a half-type cache, which those checks refuse, never reach that class (their call is refused
    the same with or without one)."""
    made = []

    class Prepared(_prepared_fake(made, "hot")):
        def __init__(self, *tensors, status=None, validate=True, **options):
            super().__init__(*tensors)

        def __call__(self, *tensors, return_lse=False):
            return "packed"

    monkeypatch.setattr(sequences, "KEPT_PAGED_CALLS", _kept_over_stand_ins(monkeypatch, sequences.KeptPagedCalls,
                                                                            Prepared))
    q, cache = _Torchish(4, 32, 1, 128), _Torchish(256, 16, 8, 128)
    lengths, table = _Torchish(4, dtype="int32"), _Torchish(4, 64, dtype="int32")
    call = lambda **descales: sequences.attention_with_kvcache(q, cache, cache, lengths, table, validate=False,  # noqa: E731
                                                               **descales)
    assert call() == "packed" and call() == "hot" and len(made) == 1
    for descales in (dict(k_descale=0.5), dict(q_descale=2.0, v_descale=0.25)):
        with pytest.raises(ValueError, match="for an FP8 cache"):
            call(**descales)
    assert made[0].calls == 1


def test_unvalidated_calls_on_other_arrays_import_no_torch(monkeypatch):
    """A kept call's memo is tried before the torch test, so it asks nothing of torch until a
    torch call has made a class: a CuPy caller without torch gets the general path's answer."""
    monkeypatch.setitem(sys.modules, "torch", None)  # (import torch raises)
    monkeypatch.setattr(sequences, "KEPT_VARLEN_CALLS", sequences.KeptVarlenCalls())
    q, k = np.zeros((64, 4, 64), np.float16), np.zeros((64, 2, 64), np.float16)
    cu = np.array([0, 64], np.int32)
    with pytest.raises(ValueError, match="host"):
        sequences.attention_varlen(q, k, k, cu, cu, 64, 64, validate=False)
    assert sequences.KeptPagedCalls().again(q, k, k, cu, cu, None, None, False, (False, None, None, None, None)) \
        is NotImplemented
