"""Draft names: `default` (the best shipped head for the bundled model), `hass` (the HASS baseline head), or a
path (a head folder, or a standalone draft model folder / GGUF)."""
from __future__ import annotations

import os

DRAFTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "drafts")
SHIPPED = {"hass": "smollm2-135m-hass"}
SHIPPED["default"] = SHIPPED["hass"]  # until an RCSD head beats it


def resolve_draft(name: str | None) -> str | None:
    if name is None:
        return None
    if name in SHIPPED:
        path = os.path.join(DRAFTS_DIR, SHIPPED[name])
        if not os.path.isdir(path):
            raise FileNotFoundError(f"draft {name!r}: the shipped head {path} is missing from this install")
        return path
    if not os.path.exists(name):
        raise FileNotFoundError(f"draft {name!r} not found: give 'default', 'hass' or a path")
    return name
