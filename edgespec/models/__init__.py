"""Named model pairs: the demo pair bundled with edgespec, and the recipe that rebuilds it."""

from __future__ import annotations

from pathlib import Path

from edgespec.errors import EdgespecError

DEMO_PACKAGE = Path(__file__).parent / "demo"


def demo_package() -> Path:
    """The exported demo pair inside the installed package."""
    if not (DEMO_PACKAGE / "edgespec.json").is_file():
        raise EdgespecError(
            f"the bundled demo pair is missing from {DEMO_PACKAGE}; pass a package folder, "
            "or rebuild it with 'edgespec models build-demo'"
        )
    return DEMO_PACKAGE
