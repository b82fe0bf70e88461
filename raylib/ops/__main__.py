"""`python -m raylib.ops build [--force] [--strict]`: builds the C++ kernels of the CPU paths once
into their cache folder (raylib.ops.native), and the DeepSpeed JIT op every CPU run loads
(raylib.train.ds_ops.prebuild), so that no test or training run pays for a build.
`make setup` runs it right after installing. Prints a line each; exits 0 even when the kernels
cannot be built (the ops then run the PyTorch reference) unless --strict."""

from __future__ import annotations

import argparse
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raylib.ops")
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="build the CPU kernels (a no-op when this build is cached)")
    build.add_argument("--force", action="store_true", help="rebuild even when cached")
    build.add_argument("--strict", action="store_true", help="exit 1 when the kernels cannot be built")
    args = parser.parse_args(argv)

    from raylib.ops import native
    from raylib.train import ds_ops

    # DeepSpeed's own JIT op first: every training run loads it (a no-op when built)
    start = time.perf_counter()
    try:
        loaded = ds_ops.prebuild()
        took = time.perf_counter() - start
        print(f"DeepSpeed ops: {', '.join(loaded) or 'none needed'} ready in {took:.0f} s")
    except Exception as e:  # a worker builds them itself then; say why here
        print(f"DeepSpeed ops: not prebuilt ({type(e).__name__}: {str(e)[:200]}); the first run builds them")

    try:
        so, seconds = native.build(force=args.force)
    except RuntimeError as e:
        print(f"raylib kernels: not built ({e}); the fused CPU ops fall back to the PyTorch reference")
        return 1 if args.strict else 0
    if seconds:
        print(f"raylib kernels: built the CPU kernels in {seconds:.0f} s into {so.parent}")
    else:
        print(f"raylib kernels: CPU kernels already built ({so.parent})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
