"""Draft names: `default` (the best shipped head for the bundled model), `hass` (the HASS baseline head), `mtp`
(the target checkpoint's own multi-token prediction layer), or a path (a head folder, or a standalone draft model
folder / GGUF)."""
from __future__ import annotations

import enum
import json
import os

DRAFTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "drafts")
# hass: the base head (lanner train-base, 8M tokens); grpo: it after RCSD GRPO on 200 prompts (mean tau +0.6% at
# k = 3 and 6 over 4 datasets); default: it after direct acceptance losses on the whole ShareGPT training split and
# 1,500 HumanEval-style code tasks, LK and then greedy verification's (+12.2% / +14.4%; docs/draft-heads.md)
SHIPPED = {"hass": "smollm2-135m-base", "grpo": "smollm2-135m-base-grpo", "lk": "smollm2-135m-base-lk-code"}
SHIPPED["default"] = SHIPPED["lk"]
MTP = "mtp"  # not a folder: the engine builds the draft from the target's own checkpoint
HEAD_ARCH = "LannerDraftHead"  # config.json "architectures" of a draft head folder (lanner.spec.draft_head)


class DraftKind(enum.Enum):
    HEAD = "head"  # an EAGLE-style head over the target's features
    MTP = "mtp"  # the target checkpoint's own multi-token prediction layer
    MODEL = "model"  # a standalone smaller model sharing the tokenizer


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


def is_draft_head(path: str) -> bool:
    cfg = os.path.join(path, "config.json")
    if not (os.path.isdir(path) and os.path.isfile(cfg)):
        return False
    with open(cfg) as f:
        return json.load(f).get("architectures") == [HEAD_ARCH]


def draft_kind(name: str | None) -> DraftKind | None:
    """What the draft `name` is, from its files (nothing is loaded)."""
    path = resolve_draft(name)
    if path is None:
        return None
    if path == MTP:
        return DraftKind.MTP
    return DraftKind.HEAD if is_draft_head(path) else DraftKind.MODEL
