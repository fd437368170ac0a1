"""fagen: fused attention kernels generated from a YAML spec."""

import importlib
import pkgutil
from typing import TYPE_CHECKING

from fagen.api import (attention, compile, mla_decode, prepare, prepare_mla_decode, prepare_varlen,  # noqa: F401
                       prepare_with_kvcache)
from fagen.version import __version__  # noqa: F401

if TYPE_CHECKING:
    from fagen.load import load_spec, parse_spec
    from fagen.rendering import render
    from fagen.sequences import attention_varlen, attention_with_kvcache
    from fagen.spec import AttentionSpec, SpecError


# The submodules (fagen.oracle, fagen.masks, fagen.sequences, ...), each imported on first use
# (PEP 562): `import fagen` stays free of CuPy and PyTorch, and fagen.oracle works after it.
SUBMODULES = frozenset(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


# The names the package exports from its submodules, each bound at its first lookup: `import
# fagen` loads neither pydantic, Jinja2 nor NumPy (0.7 s of a fresh process on an H200 host), and
# a serving loop's fagen.attention_varlen is fagen.sequences' own function (a forwarding frame's
# **kwargs cost 1-1.6 us a call).
EXPORTS = {"attention_varlen": "sequences", "attention_with_kvcache": "sequences", "render": "rendering",
           "load_spec": "load", "parse_spec": "load", "AttentionSpec": "spec", "SpecError": "spec"}


def __getattr__(name: str):
    if name in EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    if name in SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | SUBMODULES | set(EXPORTS))


__all__ = ["AttentionSpec", "SpecError", "__version__", "attention", "attention_varlen", "attention_with_kvcache",
           "compile", "load_spec", "mla_decode", "parse_spec", "prepare", "prepare_mla_decode", "prepare_varlen",
           "prepare_with_kvcache", "render"]
