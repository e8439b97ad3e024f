"""The lowest versions pyproject.toml claims are the versions a CI job runs.

Each lower bound of pyproject.toml (``torch``, ``transformers``; the ``trl`` extra's ``trl``, ``peft``, ``accelerate``)
is pinned in ``scripts/constraints-floor.txt``, which ``scripts/floor-env`` installs into ``.venv-floor`` and
``scripts/dev test`` tests there (``test-floor``); the ``verl`` extra's floor is the release ``scripts/verl-env``
installs. Read from the files, nothing is installed here; in the floor and verl environments
(``SHAREDPREFIX_REQUIRE_FLOOR``, ``SHAREDPREFIX_REQUIRE_VERL``) the installed versions are checked too.
"""

import os
import pathlib
import re
from importlib import metadata

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+ (CI runs 3.11)")

ROOT = pathlib.Path(__file__).resolve().parents[1]
FLOOR_FILE = ROOT / "scripts" / "constraints-floor.txt"
# the requirements whose floor a CI job must run, by where pyproject.toml lists them
CHECKED = {"dependencies": {"torch", "transformers"}, "trl": {"trl", "peft", "accelerate"}, "verl": {"verl"}}


def _requirements() -> dict[str, dict[str, Requirement]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lists = {"dependencies": project["dependencies"], **project["optional-dependencies"]}
    return {where: {Requirement(r).name: Requirement(r) for r in lists[where]} for where in CHECKED}


def _floor(req: Requirement) -> Version:
    lows = [Version(s.version) for s in req.specifier if s.operator == ">="]
    assert len(lows) == 1, f"pyproject.toml's {req} has no single '>=' floor; give it one (a CI job tests it)"
    return lows[0]


def _pins(text: str) -> dict[str, Version]:
    pins = {}
    for line in text.splitlines():
        line = line.split("#")[0].strip()
        if line:
            m = re.fullmatch(r"([A-Za-z0-9_.-]+)==([^\s;]+)", line)
            assert m, f"scripts/constraints-floor.txt: {line!r} is not 'name==version'"
            pins[m.group(1).lower()] = Version(m.group(2))
    return pins


def _claimed() -> dict[str, Version]:
    reqs = _requirements()
    return {name: _floor(reqs[where][name]) for where, names in CHECKED.items() for name in names}


def test_floor_file_pins_every_claimed_floor():
    claimed = _claimed()
    verl = claimed.pop("verl")
    pins = _pins(FLOOR_FILE.read_text())
    assert pins == claimed, (
        f"scripts/constraints-floor.txt pins {pins}, pyproject.toml's floors are {claimed}: the floor job must install "
        "exactly the floors; change both together (and run scripts/dev test-floor)"
    )
    verl_env = (ROOT / "scripts" / "verl-env").read_text()
    assert f'"verl=={verl}"' in verl_env, (
        f"pyproject.toml's verl extra has the floor {verl}, but scripts/verl-env does not install verl=={verl}"
    )


def test_floor_job_is_wired_into_ci():
    floor_env = (ROOT / "scripts" / "floor-env").read_text()
    assert "FLOORS=scripts/constraints-floor.txt" in floor_env and '-c "$FLOORS" -e ".[trl]"' in floor_env
    dev = (ROOT / "scripts" / "dev").read_text()
    test_step = dev[dev.index("\n  test)") : dev.index("\n    ;;", dev.index("\n  test)"))]
    steps = {line.strip() for line in test_step.splitlines()}
    assert "scripts/dev test-floor" in steps, "scripts/dev test no longer runs the floor job (test-floor)"
    assert "scripts/dev test-verl" in steps, "scripts/dev test no longer runs the verl job (test-verl)"
    assert "$(scripts/floor-env)" in dev and "SHAREDPREFIX_REQUIRE_FLOOR=1" in dev
    assert "exec scripts/dev test" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.skipif(not os.environ.get("SHAREDPREFIX_REQUIRE_FLOOR"), reason="the floor environment only")
@pytest.mark.parametrize("name", sorted(set().union(*CHECKED.values()) - {"verl"}))
def test_installed_version_is_the_floor(name):
    got = Version(metadata.version(name)).public  # torch's local label (+cpu) is no other release
    want = _claimed()[name]
    assert Version(got) == want, f"{name} {got} is installed in the floor environment, its floor is {want}"


@pytest.mark.skipif(not os.environ.get("SHAREDPREFIX_REQUIRE_VERL"), reason="the verl environment only")
def test_installed_verl_is_the_floor():
    got, want = Version(metadata.version("verl")), _claimed()["verl"]
    assert got == want, f"verl {got} is installed in the verl environment, the verl extra's floor is {want}"


def _pin(path: pathlib.Path, name: str) -> str:
    pins = [line.split("==")[1].strip() for line in path.read_text().splitlines() if line.startswith(f"{name}==")]
    assert len(pins) == 1, f"{path.name} pins {name} {len(pins)} times"
    return pins[0]


def test_per_family_versions_are_the_tested_ones():
    """``model.versions``: FLOOR is the floor job's transformers, CI the main environment's, and the families taken
    from the floor include those the floor job's exactness tests build (``TEST_SETTINGS``)."""
    from helpers import TEST_SETTINGS
    from sharedprefix.model import versions

    assert versions.FLOOR == _pin(FLOOR_FILE, "transformers")
    assert versions.CI == _pin(ROOT / "scripts" / "constraints.txt", "transformers")
    assert versions.AT_FLOOR >= set(TEST_SETTINGS)
    assert not versions.AT_FLOOR & versions.AT_VERL
    assert "tests/attention/test_exact.py" in (ROOT / "scripts" / "dev").read_text()


def test_a_family_older_than_its_verified_release_is_refused():
    from types import SimpleNamespace

    from sharedprefix.model import versions

    llama, doge = (SimpleNamespace(config=SimpleNamespace(model_type=t)) for t in ("llama", "doge"))
    versions.check_version(llama, installed=versions.FLOOR)
    versions.check_version(doge, installed=versions.CI)
    with pytest.raises(ValueError, match=r"verified exact with transformers 5\.4\.0 .* Upgrade transformers"):
        versions.check_version(llama, installed="5.3.0")
    with pytest.raises(ValueError, match=rf"'doge'\) was verified exact with transformers {versions.CI}"):
        versions.check_version(doge, installed=versions.VERL)
