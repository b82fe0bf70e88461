"""BERT masked-LM pretraining: the entrypoint for `ray job submit`.

    ray job submit --working-dir . -- python jobs/pretrain_bert.py --config jobs/configs/tiny.yaml

Inside a Ray job RAY_ADDRESS is set, so the run joins that cluster; run locally, it starts an
embedded one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# In a Ray job the working dir is the checkout: make `raylib` importable even if not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="jobs/configs/demo.yaml", help="JobSpec YAML")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a spec field")
    parser.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS or embedded)")
    args = parser.parse_args(argv)

    from raylib.cli import main as raylib_main

    cli_args = ["run", args.config, "--no-progress"]
    for item in args.overrides:
        cli_args += ["--set", item]
    if args.address:
        cli_args += ["--address", args.address]
    return raylib_main(cli_args)


if __name__ == "__main__":
    sys.exit(main())
