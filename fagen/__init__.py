"""fagen: fused attention kernels generated from a YAML spec."""

import importlib
import pkgutil

from fagen.api import (attention, attention_varlen, attention_with_kvcache, compile, mla_decode,  # noqa: F401
                       prepare, prepare_mla_decode, prepare_varlen, prepare_with_kvcache)
from fagen.render import render
from fagen.version import __version__  # noqa: F401
from fagen.load import load_spec, parse_spec
from fagen.spec import AttentionSpec, SpecError


# The submodules (fagen.oracle, fagen.masks, fagen.sequences, ...), each imported on first use
# (PEP 562): `import fagen` stays free of CuPy and PyTorch, and fagen.oracle works after it.
SUBMODULES = frozenset(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def __getattr__(name: str):
    if name in SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | SUBMODULES)


__all__ = ["AttentionSpec", "SpecError", "__version__", "attention", "attention_varlen", "attention_with_kvcache",
           "compile", "load_spec", "mla_decode", "parse_spec", "prepare", "prepare_mla_decode", "prepare_varlen",
           "prepare_with_kvcache", "render"]
