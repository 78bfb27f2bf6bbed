"""Tokenizer (transformers' fast tokenizers), chat template, and incremental detokenization."""
from __future__ import annotations

import json
import os
import re
import secrets

from tokenizers import Tokenizer as RustTokenizer

from lanner.models.loader import ModelSource, load_tokenizer

# message fields whose values steer the template's branches rather than being text it prints
_STRUCTURAL_KEYS = frozenset({"role", "type"})


class Tokenizer:
    def __init__(self, source: ModelSource, eos_token_ids: list[int] = (), architecture: str | None = None):
        self.hf = load_tokenizer(source, architecture)
        self.architecture = architecture  # (lanner.tool_formats.family_of falls back on it)
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
        # untrusted text goes through its own copy of the Rust tokenizer with special-token parsing off for good:
        # transformers' split_special_tokens=True flips that flag on the shared backend per call, and requests
        # are tokenized on several threads, so one request's user text would make another's template split its
        # own <|im_start|> into plain text
        self._plain = RustTokenizer.from_str(self.hf.backend_tokenizer.to_str())
        self._plain.encode_special_tokens = True
        self._plain.no_truncation()
        self._plain.no_padding()

    def encode(self, text: str) -> list[int]:
        """A raw prompt: special-token strings in it ARE parsed as special tokens (as vLLM and HF do)."""
        return self.hf.encode(text, add_special_tokens=True)

    def encode_text(self, text: str) -> list[int]:
        """Untrusted text: special-token strings in it stay plain text."""
        return self._plain.encode(text, add_special_tokens=False).ids if text else []

    def decode(self, ids, skip_special_tokens=True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            chat_template: str | None = None, **template_kwargs) -> list[int]:
        """Token ids of `messages` rendered with the model's chat template (or `chat_template`, e.g.
        lanner.tool_calls' for tools), plus the generation prompt. Only the template's own text may hold special
        tokens: every string a message carries (content, name, ...; not role or type) is tokenized as plain text,
        so a user who types "<|im_end|>" cannot forge turns. The template is rendered with a random placeholder per
        string, then the pieces between placeholders are tokenized with special tokens and the strings without.
        `tools` (the application's function definitions, rendered as JSON) are passed as they are."""
        template = chat_template or self.hf.chat_template
        if not template:
            raise ValueError("this model's tokenizer has no chat template; use the completions API")
        nonce = secrets.token_hex(8)
        texts: list[str] = []

        def hide(value, key=None):
            # an empty string stays empty: a placeholder would be truthy and change the template's branches
            if isinstance(value, str) and value and key not in _STRUCTURAL_KEYS:
                texts.append(value)
                return f"LANNER{nonce}T{len(texts) - 1}E"
            if isinstance(value, dict):
                return {k: hide(v, k) for k, v in value.items()}
            if isinstance(value, list):
                return [hide(v) for v in value]
            return value

        rendered = self.hf.apply_chat_template(hide(messages), tools=tools, chat_template=template,
                                               add_generation_prompt=True, tokenize=False, **template_kwargs)
        ids: list[int] = []
        # re.split with one group alternates: template text, placeholder index, template text, ...
        for i, piece in enumerate(re.split(f"LANNER{nonce}T(\\d+)E", rendered)):
            if i % 2:
                ids += self.encode_text(texts[int(piece)])
            elif piece:
                ids += self.hf.encode(piece, add_special_tokens=False)
        return ids


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
