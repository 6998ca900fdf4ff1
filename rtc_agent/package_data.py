"""Where the files that ship beside the code lie: the call page (`web/`) and the model cards (`models/`).

In the repository both are top-level folders; the wheel carries them inside the package, as `rtc_agent/web/` and
`rtc_agent/models/` (pyproject.toml maps the two packages onto the folders). Each name is looked for next to this
module first (an installed wheel), then next to the package (a checkout, plain or installed in editable mode).
"""
from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


def shipped(name: str, holds: str) -> Path:
    """The folder `name` that ships with the package: `rtc_agent/<name>` installed, `<name>` in a checkout. The
    folder is known by a file it `holds` (a checkout may keep a stale `rtc_agent/<name>/` of ignored files)."""
    inside = PACKAGE / name
    return inside if (inside / holds).is_file() else PACKAGE.parent / name


WEB_DIR = shipped("web", "index.html")
MODELS_DIR = shipped("models", "tiny.json")
