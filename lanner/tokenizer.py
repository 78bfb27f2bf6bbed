"""Tokenizer (transformers' fast tokenizers), chat template, and incremental detokenization."""
from __future__ import annotations

import json
import os

from lanner.models.loader import ModelSource, load_tokenizer


class Tokenizer:
    def __init__(self, source: ModelSource, eos_token_ids: list[int] = (), architecture: str | None = None):
        self.hf = load_tokenizer(source, architecture)
        eos = set(eos_token_ids)
        if self.hf.eos_token_id is not None:
            eos.add(self.hf.eos_token_id)
        if architecture == "gemma3":  # a GGUF names only <eos>; a chat turn ends at <end_of_turn> (llama.cpp too)
            eos.add(self.hf.convert_tokens_to_ids("<end_of_turn>"))
        gen_cfg = os.path.join(source.path, "generation_config.json") if source.kind == "hf" else None
        if gen_cfg and os.path.exists(gen_cfg):
            e = json.load(open(gen_cfg)).get("eos_token_id")
            eos |= set(e if isinstance(e, list) else [e] if e is not None else [])
        self.eos_token_ids = sorted(eos)
        self.vocab_size = len(self.hf)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=True)

    def decode(self, ids, skip_special_tokens=True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if not self.hf.chat_template:
            raise ValueError("this model's tokenizer has no chat template; use the completions API")
        out = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)


class IncrementalDetokenizer:
    """Decodes a growing token list into text deltas. Decoding a short window that starts a few tokens back
    keeps multi-token characters and leading-space merges right without re-decoding the whole output."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens=True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prompt_ids[-4:])  # context so the first output token decodes with its leading space
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def add(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset :], self.skip)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return full[len(prefix) :]
