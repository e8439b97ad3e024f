"""``sharedprefix`` command line: train (the main job), verify, bench, plan.

The command modules import torch and transformers inside their ``run``, never at import time,
so that ``sharedprefix --help`` and ``sharedprefix <command> --help`` answer at once.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    from sharedprefix.cli import bench, plan, train, verify

    parser = argparse.ArgumentParser(prog="sharedprefix", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    for name, mod in {"train": train, "verify": verify, "bench": bench, "plan": plan}.items():
        p = sub.add_parser(
            name, help=mod.HELP, description=mod.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        mod.add_arguments(p)
        p.set_defaults(func=mod.run)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
