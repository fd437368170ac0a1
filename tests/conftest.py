import copy

import pytest

import fagen


def _has_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, or no device
        return False


HAS_GPU = _has_gpu()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device and CuPy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ---- spec builders shared by the spec tests ------------------------------------------------

BASE = {  # specs/attn_f16_d128.yaml
    "name": "attn_f16_d128",
    "dtype": "float16",
    "head_dim": 128,
    "tiling": {"block_q": 64, "block_kv": 64, "warps_q": 4},
    "pipeline": {"kv_smem": "separate", "stages": 1, "q_in_registers": False},
    "smem_layout": "padded",
    "mask": "none",
    "outputs": {"lse": True},
    "arch": "sm_80",
}


def base(**overrides) -> dict:
    """A valid spec dict; a dict override for a nested section updates only the keys it names."""
    spec = copy.deepcopy(BASE)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key].update(value)
        else:
            spec[key] = value
    return spec


def rejected(data: dict) -> str:
    with pytest.raises(fagen.SpecError) as info:
        fagen.parse_spec(data)
    return str(info.value)
