"""BERT masked-LM pretraining: a thin job over the generic entrypoint (`python -m raylib run CONFIG`).

    ray job submit --working-dir . -- python jobs/pretrain_bert.py --config jobs/configs/demo.yaml

Inside a Ray job RAY_ADDRESS is set, so the run joins that cluster; run locally, it starts an
embedded one.
"""

from __future__ import annotations

import sys
from pathlib import Path

# In a Ray job the working dir is the checkout: make `raylib` importable even if not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    from raylib import cli

    return cli.job_main(argv, "jobs/configs/demo.yaml", __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
