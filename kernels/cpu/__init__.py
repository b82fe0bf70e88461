"""C++ sources of the CPU paths (built by raylib.ops.native; this package only ships them)."""
