"""fagen: fused attention kernels generated from a YAML spec."""

import importlib
import pkgutil

from fagen.api import (attention, compile, mla_decode, prepare, prepare_mla_decode, prepare_varlen,  # noqa: F401
                       prepare_with_kvcache)
from fagen.render import render
from fagen.version import __version__  # noqa: F401
from fagen.load import load_spec, parse_spec
from fagen.spec import AttentionSpec, SpecError


# The submodules (fagen.oracle, fagen.masks, fagen.sequences, ...), each imported on first use
# (PEP 562): `import fagen` stays free of CuPy and PyTorch, and fagen.oracle works after it.
SUBMODULES = frozenset(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


# Entry points that are a submodule's own functions, bound at their first lookup: a serving
# loop's call goes straight to them (a forwarding frame's **kwargs cost 1-1.6 us a call)
ENTRY_POINTS = {"attention_varlen": "sequences", "attention_with_kvcache": "sequences"}


def __getattr__(name: str):
    if name in SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in ENTRY_POINTS:
        function = getattr(importlib.import_module(f"{__name__}.{ENTRY_POINTS[name]}"), name)
        globals()[name] = function
        return function
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | SUBMODULES | set(ENTRY_POINTS))


__all__ = ["AttentionSpec", "SpecError", "__version__", "attention", "attention_varlen", "attention_with_kvcache",
           "compile", "load_spec", "mla_decode", "parse_spec", "prepare", "prepare_mla_decode", "prepare_varlen",
           "prepare_with_kvcache", "render"]
