"""Draft names: `default` (the best shipped head for the bundled model), `hass` (the HASS baseline head), `mtp`
(the target checkpoint's own multi-token prediction layer), or a path (a head folder, or a standalone draft model
folder / GGUF)."""
from __future__ import annotations

import os

DRAFTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "drafts")
# default: the HASS head after RCSD GRPO (tau +1% on average over 4 datasets x k=3..6, +3-4% on ShareGPT; README)
SHIPPED = {"hass": "smollm2-135m-hass", "grpo": "smollm2-135m-rcsd-grpo"}
SHIPPED["default"] = SHIPPED["grpo"]
MTP = "mtp"  # not a folder: the engine builds the draft from the target's own checkpoint


def resolve_draft(name: str | None) -> str | None:
    if name is None or name == MTP:
        return name
    if name in SHIPPED:
        path = os.path.join(DRAFTS_DIR, SHIPPED[name])
        if not os.path.isdir(path):
            raise FileNotFoundError(f"draft {name!r}: the shipped head {path} is missing from this install")
        return path
    if not os.path.exists(name):
        raise FileNotFoundError(f"draft {name!r} not found: give 'default', 'hass', 'mtp' or a path")
    return name
