"""``python -m sharedprefix.tools.zoo [ENTRY ...] [--no-grads] [--write-docs [PATH]] [--steps]``: run the zoo, print
one line per entry and the counts; exit 1 when an entry failed. ``--write-docs`` (all entries only) rewrites the
generated table of ``docs/models.md`` (``--write-readme`` is its old name and does the same). ``--steps`` runs the
optimizer-step probe instead (``zoo.steps``: ``sp.plan_step`` against the plain accumulation, every prefix mode and
budget, groups and trees)."""

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
    p.add_argument(
        "--write-docs",
        "--write-readme",
        dest="write_docs",
        metavar="PATH",
        nargs="?",
        const=readme.PAGE,
        help=f"rewrite the zoo table of the docs page (default {readme.PAGE})",
    )
    p.add_argument("--steps", action="store_true", help="check sp.plan_step on each entry (zoo.steps)")
    args = p.parse_args(argv)
    if args.write_docs and (args.entries or args.no_grads):
        p.error("--write-docs needs the whole zoo with gradient checks: give no entries and no --no-grads")
    logging.set_verbosity_error()
    if args.steps:
        if args.write_docs or args.no_grads:
            p.error("--steps takes no --write-docs or --no-grads")
        from sharedprefix.tools.zoo import steps

        step_results = steps.run(args.entries or None, log=print)
        counts = {s: sum(r.status == s for r in step_results) for s in ("exact", "refused", "not buildable", "failed")}
        print(counts, f"{sum(r.seconds for r in step_results):.0f}s")
        return 1 if counts["failed"] else 0
    results = run(args.entries or None, grads=not args.no_grads, log=print)
    counts = {s: sum(r.status == s for r in results) for s in ("exact", "refused", "not buildable", "failed")}
    print(counts, f"{sum(r.seconds for r in results):.0f}s")
    if args.write_docs:
        readme.write(args.write_docs, readme.render(results, transformers.__version__))
        print(f"wrote the zoo table into {args.write_docs}")
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
