"""`python -m raylib ...`: the `raylib` command; the generic job entrypoint is
`python -m raylib run CONFIG --no-progress [--set KEY=VALUE ...]` (what `raylib submit` runs)."""

import sys

from raylib.cli import main

sys.exit(main())
