"""The installed versions of rlflow's dependencies against the ranges it declares.

pip refuses to install rlflow beside a dependency outside its range, but an environment can still end up with one:
an install with ``--no-deps``, a package downgraded afterwards, a conda environment with pip on top. rlflow then
fails far from the cause (an ``ImportError`` inside Lightning's CLI, a missing keyword deep in a run).
:func:`unmet` lists the dependencies whose installed version is outside rlflow's declared range, read from rlflow's
own metadata (``pyproject.toml``'s ``dependencies``), and ``rlflow`` stops at startup with one line naming them.
Optional dependencies (extras such as ``lora`` or ``math``) are checked where they are used, and so are two
dependencies that only some runs import (:data:`IMPORTED_WHEN_USED`) when they are missing.
"""

from __future__ import annotations

from importlib import metadata
from typing import NamedTuple

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

#: Dependencies imported only by the feature that uses them, which says so itself when one is missing: wandb (the
#: ``wandb`` logger; Lightning names the package) and ninja (the float32 row GEMM's build: the engine multiplies
#: through MKL without it and logs why). Their versions are checked where they are installed.
IMPORTED_WHEN_USED = frozenset({"wandb", "ninja"})


class Unmet(NamedTuple):
    """A dependency outside its declared range: its name, the installed version (None: not installed), and the
    requirement rlflow declares (``transformers>=5.0``)."""

    name: str
    installed: str | None
    wanted: str

    def __str__(self) -> str:
        found = "not installed" if self.installed is None else self.installed
        return f"{self.name} {found} (rlflow needs {self.wanted})"


def installed_version(name: str) -> str | None:
    """The installed version of the distribution ``name``; None where it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def unmet(distribution: str = "rlflow") -> list[Unmet]:
    """Each unconditional dependency of ``distribution`` that is missing or whose installed version is outside its
    range; empty when all are met, or when ``distribution`` itself has no metadata (a source tree on ``sys.path``
    without an install)."""
    try:
        declared = metadata.requires(distribution) or []
    except metadata.PackageNotFoundError:
        return []
    problems = []
    for line in declared:
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue  # an extra's dependency, or one for another platform or Python
        extras = f"[{','.join(sorted(requirement.extras))}]" if requirement.extras else ""
        wanted = f"{requirement.name}{extras}{requirement.specifier}"
        installed = installed_version(requirement.name)
        if installed is None:
            if requirement.name not in IMPORTED_WHEN_USED:
                problems.append(Unmet(requirement.name, None, wanted))
            continue
        try:
            met = requirement.specifier.contains(Version(installed), prereleases=True)
        except InvalidVersion:
            continue  # a local build whose version packaging cannot read: let it run
        if not met:
            problems.append(Unmet(requirement.name, installed, wanted))
    return problems


def message(problems: list[Unmet], level: str = "error") -> str:
    """The one line ``rlflow`` prints for :func:`unmet`'s list (``rlflow: <level>: ...``)."""
    upgrade = " ".join(f"'{p.wanted}'" for p in problems)
    return (f"rlflow: {level}: {'; '.join(map(str, problems))}. Install the versions rlflow needs: "
            f"pip install -U {upgrade}")
