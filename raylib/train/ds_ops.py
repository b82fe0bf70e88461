"""DeepSpeed's JIT-built ops (shared-memory collectives on the CPU accelerator, CPU Adam for an
offloaded optimizer), loaded before `deepspeed.initialize`, taking turns with the machine's
other raylib processes.

torch.utils.cpp_extension guards each op's build folder with a FileBaton: a plain `lock` file
that every load creates, built or not, and that a builder killed mid-way leaves behind. Every
later load of that op then waits on it forever (seen: a run hung inside deepspeed.initialize →
build_shm_op → FileBaton.wait, after a session ended during a build). Here raylib's processes
take turns under fcntl.flock, which the kernel releases when its holder dies, so a baton seen
while holding it belongs to a builder outside raylib or to a dead one: it is waited for until it
is STALE_AFTER_S old, then removed with a warning that names it."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

# A DeepSpeed op builds in 10-90 s on 2 cores; a baton older than this has no live builder.
STALE_AFTER_S = 300.0
# What DeepSpeed's CPU accelerator builds at init_distributed (raylib's workers run on it).
SHM_COMM = "ShareMemCommBuilder"
CPU_ADAM = "CPUAdamBuilder"


def build_folder(op_name: str) -> Path:
    """The folder torch builds (and keeps) this extension in: $TORCH_EXTENSIONS_DIR or
    ~/.cache/torch_extensions/<python>_<accelerator>, then the op's name."""
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory(op_name, verbose=False))


def clear_stale_baton(folder: Path, stale_after_s: float = STALE_AFTER_S, poll_s: float = 0.5) -> bool:
    """Waits while `folder/lock` is younger than stale_after_s (a live builder finishing), then
    removes it if it is still there. -> whether a baton was removed."""
    baton = folder / "lock"
    while True:
        try:
            age = time.time() - baton.stat().st_mtime
        except FileNotFoundError:
            return False
        if age >= stale_after_s:
            break
        time.sleep(min(poll_s, stale_after_s - age))  # polling a file another process removes
    baton.unlink(missing_ok=True)
    log.warning("removed a stale torch build lock %s (%.0f s old; its builder died): "
                "the op is loaded or rebuilt now", baton, age)
    return True


@contextlib.contextmanager
def _turn(root: Path) -> Iterator[None]:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".raylib-ops.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def load(op_names: list[str], stale_after_s: float = STALE_AFTER_S) -> list[str]:
    """Loads (building once if needed) the named DeepSpeed ops the current accelerator has and
    can build; DeepSpeed's later loads in this process reuse them. -> the names loaded."""
    from deepspeed.accelerator import get_accelerator

    keep_builds_in_this_venv()
    use_this_pythons_ninja()
    builders = []
    for name in op_names:
        builder = get_accelerator().create_op_builder(name)
        if builder is not None and builder.is_compatible(verbose=False):
            builders.append(builder)
    if not builders:
        return []
    folders = {b.name: build_folder(b.name) for b in builders}
    with _turn(next(iter(folders.values())).parent):
        for builder in builders:
            clear_stale_baton(folders[builder.name], stale_after_s)
            builder.load(verbose=False)
    return [b.name for b in builders]


def keep_builds_in_this_venv() -> None:
    """Build and load torch extensions in <venv>/torch_extensions unless TORCH_EXTENSIONS_DIR says
    otherwise. torch's default folder (~/.cache/torch_extensions) is shared by every venv of the
    user, and an op's build records the compiler flags of the venv that built it (its include paths
    name that venv): two checkouts with their own venvs rebuilt it back and forth, each on its
    first load after the other (73 CPU-s for shm_comm). Not outside a venv, nor where the venv is
    not writable (a system install): torch's default applies there."""
    if "TORCH_EXTENSIONS_DIR" in os.environ or sys.prefix == sys.base_prefix:
        return
    if os.access(sys.prefix, os.W_OK):
        os.environ["TORCH_EXTENSIONS_DIR"] = os.path.join(sys.prefix, "torch_extensions")


def use_this_pythons_ninja() -> None:
    """Put the `ninja` installed beside this Python (the ninja wheel) first on this process's PATH,
    for torch's builds here and DeepSpeed's later loads. torch runs the first `ninja` on PATH, and
    ninja versions keep incompatible build logs (1.11 writes v5, 1.12+ v7, each discards the
    other's): a process that finds another ninja (a system one; a Ray node whose PATH starts with
    the venv) rebuilds every op it loads, 73 CPU-s for shm_comm, and the next process builds it back."""
    bin_dir = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "")
    if os.path.isfile(os.path.join(bin_dir, "ninja")) and path.split(os.pathsep)[0] != bin_dir:
        os.environ["PATH"] = bin_dir + os.pathsep + path


def defer_muon_compile() -> None:
    """Import DeepSpeed's Muon kernels with their torch.compile deferred to their first call.

    Every ZeRO `deepspeed.initialize` imports deepspeed.runtime.zero.muon.original_muon (to ask
    whether the optimizer is Muon), whose kernels are decorated with torch.compile at import;
    building those decorators imports torch._inductor: 2.1 s of a core in every worker of every
    run (measured: all of deepspeed.initialize for a small model), for an optimizer raylib's runs
    rarely use. Here each kernel is compiled by the same torch.compile when it is first called."""
    import functools
    import importlib

    if "deepspeed.runtime.zero.muon.original_muon" in sys.modules:
        return
    from deepspeed.runtime import compiler

    original = compiler.compile

    def deferred():
        def decorate(fn):
            compiled = None

            @functools.wraps(fn)
            def call(*args, **kwargs):
                nonlocal compiled
                if compiled is None:
                    compiled = original()(fn)
                return compiled(*args, **kwargs)

            return call

        return decorate

    compiler.compile = deferred
    try:
        importlib.import_module("deepspeed.runtime.zero.muon.original_muon")
    except ImportError as e:  # another DeepSpeed: its own import path applies
        log.debug("DeepSpeed's Muon kernels not imported ahead: %s", e)
    finally:
        compiler.compile = original


def needed(offload_optimizer: bool) -> list[str]:
    """The ops a worker's deepspeed.initialize will ask for."""
    return [SHM_COMM] + ([CPU_ADAM] if offload_optimizer else [])


def prebuild() -> list[str]:
    """`make setup`: the op every CPU run loads (shm_comm), built once before any worker needs it.
    CPU Adam (45 s more of two cores) is built by the first run that offloads its optimizer, once:
    offloading saves nothing when the workers already train on the CPU."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return load([SHM_COMM])
