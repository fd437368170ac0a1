"""A prepared call's hot path in C (hot_path.c): built once per machine with the host's C
compiler against Python.h alone, cached beside the kernels' cubins, loaded as an extension
module. Where there is no compiler or the build fails, prepared calls keep the Python path
(`reason()` says why); nothing else changes.

The driver functions the C side calls come in as addresses, looked up in libcuda here."""

from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sysconfig
import warnings
from functools import cache
from pathlib import Path

from fagen import disk_cache

SOURCE = Path(__file__).with_name("hot_path.c")
MODULE = "fagen_hot_path"
COMPILE_FLAGS = ("-O2", "-shared", "-fPIC", "-std=c11")

_failure: list[str] = []  # why the module could not be had, once tried


def library_path(source: str) -> Path:
    """Where the build of `source` for this interpreter lives: keyed by the source, the flags
    and the interpreter's ABI, so an edit or another Python builds anew."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    key = hashlib.sha256("\0".join([source, *COMPILE_FLAGS, suffix]).encode()).hexdigest()[:16]
    return disk_cache.directory() / f"{MODULE}-{key}{suffix}"


def build(path: Path) -> None:
    """Compile hot_path.c to `path` (atomically: a concurrent process sees the whole library or
    none); RuntimeError with the compiler's output where it fails."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc, gcc or $CC) on PATH")
    include = sysconfig.get_paths()["include"]
    if not Path(include, "Python.h").exists():
        raise RuntimeError(f"no Python.h in {include} (install the interpreter's development headers)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    done = subprocess.run([compiler, *COMPILE_FLAGS, f"-I{include}", str(SOURCE), "-o", str(tmp)],
                          capture_output=True, text=True)
    if done.returncode:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"{compiler} failed on {SOURCE.name}:\n{done.stderr}")
    tmp.replace(path)


@cache
def module():
    """The compiled extension module, or None where it cannot be built (see `reason`)."""
    try:
        path = library_path(SOURCE.read_text())
        if not path.exists():
            build(path)
        loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
        spec = importlib.util.spec_from_file_location(MODULE, str(path), loader=loader)
        loaded = importlib.util.module_from_spec(spec)
        loader.exec_module(loaded)
        return loaded
    except (OSError, RuntimeError, ImportError) as error:
        _failure.append(str(error))
        warnings.warn(f"fagen: prepared calls take the Python path (a few microseconds more a call): {error}",
                      RuntimeWarning, stacklevel=2)
        return None


def reason() -> str | None:
    """Why prepared calls run the Python path (None where the module loaded)."""
    return None if module() is not None else _failure[-1]


@cache
def driver_functions() -> tuple[int, int, int]:
    """The addresses of cuLaunchKernelEx, cuStreamIsCapturing and cuTensorMapEncodeTiled in libcuda."""
    cuda = ctypes.CDLL("libcuda.so.1")
    return tuple(ctypes.cast(getattr(cuda, name), ctypes.c_void_p).value
                 for name in ("cuLaunchKernelEx", "cuStreamIsCapturing", "cuTensorMapEncodeTiled"))


def launch_entry(launch, positions: tuple[int, ...], addresses: int, owner) -> tuple:
    """A Launch as HotPath takes it: its driver call, the slot each of the call's `addresses`
    (the inputs, out, lse) goes to (-1: not re-pointed), its tensor maps' encodings (each follows
    one of the addresses, which are its slots' order where it has maps), and what the C side
    keeps alive: `owner`, the Launch, whose buffers it writes, beside what its arguments point at."""
    slots = [-1] * addresses
    for slot, position in zip(launch.slots, positions):
        slots[position] = slot
    if launch.maps and positions != tuple(range(len(launch.slots))):
        raise ValueError("a launch with tensor maps re-points the inputs, out and lse in that order")
    return (*launch.driver_call(), tuple(slots), launch.map_encodings(), owner)
