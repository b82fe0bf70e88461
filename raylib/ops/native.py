"""The C++ kernels of the CPU paths (kernels/cpu): found, built once per machine, loaded.

The sources ship in the wheel as the namespace package `raylib_kernels` (the repository's kernels/
folder, kept free of __init__.py so that it never shadows an installed `kernels`: kernels/README.md);
in a source checkout that is not installed they are read from <repo>/kernels. They are built with
torch.utils.cpp_extension into a cache folder keyed by everything the binary depends on (the
sources, torch's version, Python's, the compiler and its flags, this CPU: the build uses
-march=native), `$RAYLIB_KERNELS_CACHE/<key>` (default ~/.cache/raylib/kernels/<key>), and later
processes load that .so directly, without a compiler. `make setup` builds it
(`python -m raylib.ops build`); otherwise the first process that needs it does, under a file lock
so that concurrent workers build it once.

`ready()` never raises: None when the module loads, else why not (no compiler, the build's first
error lines), which dispatch shows when it falls back to the PyTorch reference."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import io
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

NAME = "raylib_cpu_kernels"
SOURCES = ("elementwise.cpp", "fused_math.h")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-fno-math-errno", "-w")
# -fopenmp makes at::parallel_for parallel (ATen's OpenMP backend is header code); the extension
# links the libgomp torch already loaded (same soname), so both share one thread pool.
LDFLAGS = ("-fopenmp",)

_lock = threading.Lock()
_module: ModuleType | None = None
_failure: str | None = None


def kernels_dir() -> Path:
    """The kernels/ folder: the installed `raylib_kernels` package, else the source checkout's."""
    try:
        spec = importlib.util.find_spec("raylib_kernels")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            if (Path(location) / "cpu").is_dir():
                return Path(location)
    return Path(__file__).resolve().parents[2] / "kernels"


def cache_root() -> Path:
    root = os.environ.get("RAYLIB_KERNELS_CACHE") or os.path.join(Path.home(), ".cache", "raylib", "kernels")
    return Path(root)


def _compiler() -> str:
    return os.environ.get("CXX") or "c++"


def _cpu_id() -> str:
    """What -march=native compiles for: the CPU model and its feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "flags", "Features", "CPU part") and key not in lines:
            lines[key] = value.strip()
    return repr(sorted(lines.items()))


def _compiler_version() -> str:
    try:
        out = subprocess.run([_compiler(), "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0] if out.stdout else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def cache_key() -> str:
    """sha256 (16 hex digits) of what the binary depends on."""
    h = hashlib.sha256()
    src = kernels_dir() / "cpu"
    for name in SOURCES:
        h.update(name.encode() + b"\0" + (src / name).read_bytes() + b"\0")
    for part in (torch.__version__, sys.version, platform.machine(), _compiler(), _compiler_version(),
                 " ".join(CFLAGS), " ".join(LDFLAGS), _cpu_id()):
        h.update(str(part).encode() + b"\0")
    return h.hexdigest()[:16]


def build_dir() -> Path:
    return cache_root() / cache_key()


def _so_path(directory: Path) -> Path:
    return directory / f"{NAME}.so"


def _import_so(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(NAME, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _why_cannot_build() -> str | None:
    if shutil.which(_compiler()) is None:
        return f"no C++ compiler ({_compiler()} is not on PATH; set CXX)"
    if shutil.which("ninja") is None:
        return "ninja is not installed (pip install ninja)"
    return None


def _first_error_lines(text: str, n: int = 2) -> str:
    """The compiler's first `error:` lines (file names without their folders), else the last lines."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = ([ln for ln in lines if "error:" in ln] or [ln for ln in lines if "error" in ln.lower()]
              or lines[-n:])
    return " | ".join(re.sub(r"\S*/", "", ln) for ln in errors[:n])[:400]


def _compile(directory: Path) -> None:
    from torch.utils import cpp_extension

    src = kernels_dir() / "cpu"
    directory.mkdir(parents=True, exist_ok=True)
    # torch renames a second build of one extension name in a process (name_v1, and its init
    # symbol with it); every build here is a fresh folder, so start its count again
    getattr(getattr(cpp_extension, "JIT_EXTENSION_VERSIONER", None), "entries", {}).pop(NAME, None)
    sink = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        warnings.simplefilter("ignore")
        cpp_extension.load(NAME, [str(src / SOURCES[0])], extra_cflags=list(CFLAGS),
                           extra_ldflags=list(LDFLAGS), extra_include_paths=[str(src)],
                           build_directory=str(directory), verbose=False, is_python_module=False)


def build(force: bool = False) -> tuple[Path, float]:
    """Builds the module unless this key's .so is there already; -> (.so path, seconds spent
    building, 0.0 when cached). Raises RuntimeError with the reason when it cannot build."""
    why = _why_cannot_build()
    directory = build_dir()
    so = _so_path(directory)
    if so.exists() and not force:
        return so, 0.0
    if why:
        raise RuntimeError(why)
    directory.parent.mkdir(parents=True, exist_ok=True)
    with open(directory.parent / f"{directory.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same key
        if so.exists() and not force:
            return so, 0.0
        # Built aside, then renamed into place: a .so under the key's folder is always complete,
        # and a forced rebuild never rewrites a file another process has mapped.
        staging = directory.with_name(f"{directory.name}.build-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        start = time.perf_counter()
        try:
            _compile(staging)
        except Exception as e:  # the compiler's own message is in the exception
            shutil.rmtree(staging, ignore_errors=True)
            raise RuntimeError(f"build failed: {_first_error_lines(str(e))}") from e
        if not _so_path(staging).exists():
            raise RuntimeError(f"build produced no {so.name} in {staging}")
        shutil.rmtree(directory, ignore_errors=True)
        os.replace(staging, directory)
        return so, time.perf_counter() - start


def module() -> ModuleType:
    """The loaded extension (built first if needed). Raises RuntimeError with the reason."""
    global _module, _failure
    if _module is not None:
        return _module
    with _lock:
        if _module is None:
            if _failure is not None:
                raise RuntimeError(_failure)
            try:
                so, seconds = build()
                if seconds:
                    log.info("raylib kernels: built the CPU kernels in %.0f s into %s", seconds, so.parent)
                _module = _import_so(so)
            except Exception as e:
                _failure = str(e) if isinstance(e, RuntimeError) else f"{type(e).__name__}: {e}"
                raise RuntimeError(_failure) from e
    return _module


def ready() -> str | None:
    """None when the CPU kernels load here, else why not. Never raises."""
    try:
        module()
    except Exception as e:
        return f"C++ kernels unavailable: {e}"
    return None


# -- the Triton kernels of the CUDA paths (kernels/triton) ---------------------------------------

_triton_modules: dict[str, ModuleType] = {}
_TRITON_FILES = ("bias_gelu", "layer_norm")


def triton_kernels(name: str) -> ModuleType:
    """kernels/triton/<name>.py, imported by file path (this imports triton)."""
    if name not in _triton_modules:
        path = kernels_dir() / "triton" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(f"raylib_kernels_triton_{name}", path)
        if spec is None or spec.loader is None:
            raise ImportError(f"no Triton kernels at {path}")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _triton_modules[name] = mod
    return _triton_modules[name]


def triton_ready() -> str | None:
    """None when the Triton kernels can run here (Triton installed, a CUDA device), else why not."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install 'raylib-train[gpu]')"
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        for name in _TRITON_FILES:
            triton_kernels(name)
    except Exception as e:
        return f"Triton kernels failed to import: {type(e).__name__}: {e}"
    return None
