"""``sharedprefix`` command line: train (the main job), verify, bench, plan."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="sharedprefix", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    from sharedprefix.cli import bench, plan, verify

    commands = {"verify": verify, "bench": bench, "plan": plan}
    try:
        from sharedprefix.cli import train

        commands = {"train": train, **commands}
    except ImportError as e:  # the trainer needs optional extras; say so instead of hiding the command
        _missing = str(e)

        def _train_missing(_args):
            print(f"sharedprefix train needs the 'trl' extra: pip install 'sharedprefix[trl]' ({_missing})",
                  file=sys.stderr)
            return 2

        p = sub.add_parser("train", help="GRPO on an embedded default (needs the trl extra)")
        p.set_defaults(func=_train_missing)
    for name, mod in commands.items():
        p = sub.add_parser(name, help=mod.HELP, description=mod.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(func=mod.run)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
