"""The model zoo: every causal-LM architecture transformers registers, built tiny, through sharedprefix.

``configs`` builds each architecture tiny (float64, random weights), ``checks`` requires each to be exact
against the plain forward, refused before any computation with its reason, or not buildable with its
reason, and ``readme`` turns the results into the table of ``docs/models.md`` (``python -m sharedprefix.tools.zoo
--write-docs``), so that the table cannot drift from what the zoo checks. A tool beside the library:
nothing in the library imports it.
"""

from sharedprefix.tools.zoo.checks import EXPECTED_NOT_BUILDABLE, REFUSALS, Result, check, run
from sharedprefix.tools.zoo.configs import NotBuildable, architectures, build, entries, groups, tiny_config

__all__ = [
    "EXPECTED_NOT_BUILDABLE",
    "NotBuildable",
    "REFUSALS",
    "Result",
    "architectures",
    "build",
    "check",
    "entries",
    "groups",
    "run",
    "tiny_config",
]
