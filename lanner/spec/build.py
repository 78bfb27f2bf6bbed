"""Builds the speculation a config asks for: the draft it names (loaded before the KV system, which sizes its pool
and captures the layers the draft reads), then the proposer over it and the SpecDecoder that runs it. Which
combinations are valid the config has already checked (lanner.config); what only the loaded weights can tell (a
head built for another target) is checked here."""
from __future__ import annotations

import os
from dataclasses import dataclass

from lanner.distributed import tp_disabled
from lanner.engine.runner import ModelRunner
from lanner.models.loader import ModelSource, load_model
from lanner.spec.base import Proposer
from lanner.spec.decoder import SpecDecoder
from lanner.spec.draft_head import DraftHead
from lanner.spec.drafts import DraftKind, resolve_draft
from lanner.spec.hybrid import HybridProposer
from lanner.spec.learn import DraftLearner, published_head
from lanner.spec.mtp import MtpProposer, load_mtp
from lanner.spec.proposers import DraftHeadProposer, DraftModelProposer, NgramProposer
from lanner.spec.suffix import SuffixProposer


@dataclass
class LoadedDraft:
    kind: DraftKind
    module: object  # DraftHead, MtpLayer or a standalone model

    def capture(self, num_layers: int) -> tuple[int, ...]:
        """The target layers whose outputs the draft reads (an MTP layer's: the last layer's output, the hidden
        state before the final norm)."""
        if self.kind is DraftKind.HEAD:
            return tuple(self.module.cfg.feature_layers)
        return (num_layers - 1,) if self.kind is DraftKind.MTP else ()

    def kv_bytes_per_token(self, dtype) -> int:
        """KV bytes per token of the draft's pool (it shares the target's block tables, and so its budget)."""
        return ModelRunner.bytes_per_token(self.module.model_cfg if self.kind is DraftKind.HEAD else self.module,
                                           dtype)


def load_draft(config, source: ModelSource, target, model_config) -> LoadedDraft | None:
    """The draft of config.draft (None without one). Built outside the tensor-parallel group: drafts run whole on
    rank 0."""
    kind = config.draft_kind
    if kind is None:
        return None
    path = resolve_draft(config.draft)
    if config.learn_draft is not None:  # a restart serves the newest head it learned
        path = published_head(config.learn_draft) or path
    with tp_disabled():
        if kind is DraftKind.MTP:
            return LoadedDraft(kind, load_mtp(source, target, config.torch_dtype, config.device))
        if kind is DraftKind.HEAD:
            head, tcfg = DraftHead.load(path, config.torch_dtype, config.device), model_config
            hc = head.cfg
            if hc.target_vocab_size != tcfg.vocab_size or hc.hidden_size != tcfg.hidden_size or \
                    max(hc.feature_layers) >= tcfg.num_layers:
                raise ValueError(f"draft: the head at {path} was built for another target (vocab "
                                 f"{hc.target_vocab_size}, hidden {hc.hidden_size}); this model has vocab "
                                 f"{tcfg.vocab_size}, hidden {tcfg.hidden_size}")
            if hc.num_layers != 1:
                raise ValueError(f"draft: the head at {path} has {hc.num_layers} decoder layers; serving runs "
                                 "one-layer heads (deeper ones are a train-curve option)")
            return LoadedDraft(kind, head)
        draft, cfg = load_model(ModelSource.resolve(path), config.torch_dtype, config.device)
    if cfg.vocab_size != model_config.vocab_size:
        raise ValueError(f"draft: its vocabulary ({cfg.vocab_size}) differs from the target's "
                         f"({model_config.vocab_size}); a draft model must share the tokenizer")
    return LoadedDraft(kind, draft)


def build_proposer(config, draft: LoadedDraft | None, target, kv, plugins, embed_weight=None) -> Proposer | None:
    """The proposer of config.spec over `draft`. kv: the KV system (lanner.engine.kv_system), whose block tables a
    draft's KV shares where it has them (num_blocks set; else a head keeps blocks of its own); embed_weight: the
    whole embedding table where the target's is a tensor-parallel shard."""
    if config.spec is None:
        return None
    if config.spec == "ngram":
        return NgramProposer(config.ngram_min, config.ngram_max)
    proposer = None
    if draft is not None:
        args = (kv.num_blocks, config.block_size, config.torch_dtype, config.device, plugins)
        tables = kv.block_table if kv.num_blocks is not None else None
        with tp_disabled():
            if draft.kind is DraftKind.HEAD:
                proposer = DraftHeadProposer(draft.module, target, *args, embed_weight=embed_weight,
                                             tree=config.spec_tree, depth=config.spec_tokens, block_table=tables)
            elif draft.kind is DraftKind.MTP:
                proposer = MtpProposer(draft.module, target, *args, embed_weight=embed_weight, block_table=tables)
            else:
                proposer = DraftModelProposer(draft.module, *args, block_table=tables)
    if config.spec in ("suffix", "hybrid"):
        suffix = SuffixProposer(max_depth=config.spec_max_tokens if config.spec_tree else 0)
        return suffix if config.spec == "suffix" else HybridProposer(suffix, proposer, config.spec_tokens)
    return proposer


def build_spec(config, draft: LoadedDraft | None, proposer: Proposer | None, embed, metrics) -> SpecDecoder:
    """The SpecDecoder running `proposer`, with the continual-learning trainer when config.learn_draft is set.
    embed: the target's embedding module (its dense `weight` is read only for the trainer: a stored-type
    embedding builds that copy on each access, ~0.9 GB float32 at a 152k vocabulary)."""
    learner = None
    if config.learn_draft is not None:
        learner = DraftLearner(config.learn_draft, draft.module, embed.weight,
                               {"base_head": resolve_draft(config.draft), "steps": config.spec_tokens,
                                "parent_pid": os.getpid()})
    return SpecDecoder(proposer, config, metrics, learner)
