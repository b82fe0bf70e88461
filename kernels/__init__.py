"""raylib's native kernel sources, installed as the package `raylib_kernels` (the repository's
top-level kernels/ folder): cpu/ holds the C++ that raylib.ops.native JIT-builds once per
machine, triton/ the Triton kernels of the CUDA paths (imported only where Triton is installed).

Nothing here is imported by raylib at start-up; raylib.ops.native finds these files either in an
installed wheel or in a source checkout."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent
CPU_SOURCES = ROOT / "cpu"
