"""``python -m sharedprefix.tools.zoo [ENTRY ...] [--no-grads] [--write-readme [PATH]]``: run the zoo, print one line
per entry and the counts; exit 1 when an entry failed. ``--write-readme`` (all entries only) rewrites the
README's generated table."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    import transformers
    from transformers.utils import logging

    from sharedprefix.tools.zoo import readme
    from sharedprefix.tools.zoo.checks import run

    p = argparse.ArgumentParser(prog="python -m sharedprefix.tools.zoo", description=__doc__)
    p.add_argument("entries", nargs="*", help="model types or variants (default: all)")
    p.add_argument("--no-grads", action="store_true", help="skip the gradient checks")
    p.add_argument("--write-readme", metavar="PATH", nargs="?", const="README.md", help="rewrite the README's table")
    args = p.parse_args(argv)
    if args.write_readme and (args.entries or args.no_grads):
        p.error("--write-readme needs the whole zoo with gradient checks: give no entries and no --no-grads")
    logging.set_verbosity_error()
    results = run(args.entries or None, grads=not args.no_grads, log=print)
    counts = {s: sum(r.status == s for r in results) for s in ("exact", "refused", "not buildable", "failed")}
    print(counts, f"{sum(r.seconds for r in results):.0f}s")
    if args.write_readme:
        readme.write(args.write_readme, readme.render(results, transformers.__version__))
        print(f"wrote the zoo table into {args.write_readme}")
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
