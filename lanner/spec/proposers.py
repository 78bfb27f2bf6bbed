"""The model-based draft proposers (a standalone draft model, an EAGLE-style head) and prompt lookup; the
contract they implement is lanner.spec.base."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from numpy.lib.stride_tricks import sliding_window_view

from lanner.engine.runner import ModelRunner, SeqChunk
from lanner.engine.sampling import processed_probs, sample_from_probs
from lanner.layers.attention import build_attention_metadata
from lanner.plugins import Step, StepKind
from lanner.spec.base import Draft, Proposer, draft_room


@dataclass
class DraftKV:
    """A draft model's progress on one request."""

    computed: int = 0  # positions whose KV the draft holds


@dataclass
class HeadState(DraftKV):
    """A draft head's progress on one request."""

    # target features of positions computed.. not yet consumed, as the steps appended them (joined when read: a
    # cat per step would copy the whole backlog each time, and a request the hybrid keeps on suffix drafts builds
    # one of ~10 MB)
    feature_rows: list[torch.Tensor] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)  # the head's own KV blocks (a target without block tables)

    @property
    def features(self) -> torch.Tensor | None:
        if len(self.feature_rows) > 1:
            self.feature_rows = [torch.cat(self.feature_rows)]
        return self.feature_rows[0] if self.feature_rows else None

    @features.setter
    def features(self, rows: torch.Tensor | None):
        self.feature_rows = [] if rows is None else [rows]


class NgramProposer(Proposer):
    """Prompt lookup: the longest suffix (max_n..min_n tokens) that occurred earlier in the request's own
    context; propose what followed its most recent occurrence."""
    name = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests, ks, states):
        return [Draft(self.lookup(r.all_ids, k)) for r, k in zip(requests, ks)]

    def lookup(self, ids: list[int], k: int) -> list[int]:
        if k <= 0 or len(ids) < self.min_n + 1:
            return []
        arr = np.asarray(ids, dtype=np.int64)
        for n in range(min(self.max_n, len(ids) - 1), self.min_n - 1, -1):
            windows = sliding_window_view(arr[:-1], n)  # candidate earlier occurrences (not the suffix itself)
            hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return arr[start : start + k].tolist()
        return []


class DraftModelProposer(Proposer):
    """A smaller model with the same tokenizer. Its KV pool has the target's geometry (block count and size),
    so it lives in the target's block tables: allocation, prefix sharing and rollback come for free."""
    name = "draft"

    def __init__(self, model, num_blocks: int, block_size: int, dtype, device, plugins=None, block_table=None):
        """block_table(request) -> the target's block table of a running request (lanner.engine.kv_paged)."""
        self.runner = ModelRunner(model, num_blocks, block_size, dtype, device, plugins=plugins, role="draft")
        self.block_table = block_table

    def new_state(self):
        return DraftKV()

    def restart(self, st, start):
        st.computed = start

    def propose(self, requests, ks, states):
        # draft-extend: bring the draft's KV up to the last verified token; its last row predicts d_1
        tables = [self.block_table(r) for r in requests]
        chunks = [SeqChunk(r.all_ids[st.computed :], st.computed, t) for r, st, t in zip(requests, states, tables)]
        logits = self.runner.run(chunks, StepKind.DRAFT_EXTEND)
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = [i for i in range(len(requests)) if ks[i] > 0]
        rows, j = logits[active], 0
        while active:
            for row, i in zip(rows, active):
                params = requests[i].params
                if params.greedy:
                    drafts[i].append(int(row.argmax()))
                else:
                    p = processed_probs(row[None], [params])
                    drafts[i].append(int(sample_from_probs(p, [requests[i].generator])[0]))
                    probs[i].append(p[0])
            j += 1
            active = [i for i in active if ks[i] > j]
            if active:  # feed d_j back in at position num_tokens + j - 1
                rows = self.runner.run([SeqChunk([drafts[i][-1]], requests[i].num_tokens + j - 1, tables[i])
                                        for i in active], StepKind.DRAFT)
        return [Draft(d, torch.stack(p) if p else None) for d, p in zip(drafts, probs)]

    def after_verify(self, req, st, num_proposed, num_accepted, tokens_before):
        # KV is valid up to the last draft the chain fed back in that the target also accepted
        st.computed = tokens_before + max(0, min(num_accepted, num_proposed - 1))


class DraftHeadProposer(Proposer):
    """EAGLE-3-style head over the target's features. Per request its HeadState keeps `features`: target
    features of positions `computed`.. that the head has not consumed yet (the engine appends the rows each target
    forward verified). Draft-extend consumes them; the chain then feeds the head's own hidden state back.

    Its KV pool shares the target's block tables (num_blocks: the target's pool size), or, over a KV system
    without them (num_blocks=None: UlaCache), the head keeps its own blocks per request in a pool that grows.

    tree > 0: the head drafts trees of up to that many nodes instead of chains (EAGLE-2): at each depth it
    expands the TREE_TOPK nodes of highest path probability (its confidence: a sure path keeps one child in the
    final tree, an unsure one several), each into its TREE_TOPK likeliest children; the tree is then the `tree`
    nodes of highest path probability. Candidates are a function of the draft's distribution, not sampled from
    it, so the verifier's rejection over them (lanner.spec.verify.verify_tree) is lossless for sampling too."""
    name = "draft-head"
    TREE_TOPK = 4
    tree, depth = 0, 16  # chains unless the engine asks for trees (subclasses such as MtpProposer draft chains)

    def __init__(self, head, target, num_blocks: int | None, block_size: int, dtype, device, plugins=None,
                 embed_weight: torch.Tensor | None = None, tree: int = 0, depth: int = 16, block_table=None):
        """block_table(request) -> the target's block table of a running request, when num_blocks is set."""
        self.head, self.target, self.block_size, self.device = head, target, block_size, device
        self.block_table = block_table
        self.tree, self.depth = tree, depth
        # the whole [vocab, hidden] token embedding: under tensor parallelism the target's is a vocab shard whose
        # lookup is a collective, so the engine passes a gathered copy (the head runs on rank 0 only)
        self.embed_weight = target.embed_tokens.weight if embed_weight is None else embed_weight
        self.plugins = plugins
        self.vocab = target.cfg.vocab_size
        cfg = head.model_cfg
        self.kv = torch.zeros(2, 0, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=device)
        self._init_blocks(num_blocks)

    def new_state(self):
        return HeadState()

    def restart(self, st, start):
        st.computed, st.features = start, None

    def keep_features(self, st, rows):
        st.feature_rows.append(rows)

    def _init_blocks(self, num_blocks: int | None):
        self.own_blocks = num_blocks is None
        self.free_blocks: list[int] = []
        self._grow((num_blocks or 0) * self.block_size)

    def _grow(self, slots: int):
        """`slots` more KV slots at the end of the pool (block ids stay valid)."""
        self.kv = torch.cat([self.kv, self.kv.new_zeros(2, slots, *self.kv.shape[2:])], 1)

    def _num_slots(self) -> int:
        return self.kv.shape[1]

    def _tables(self, requests, states, upto: list[int]) -> list[list[int]]:
        """The block tables the head's KV uses, holding at least positions < upto[i]."""
        if not self.own_blocks:
            return [self.block_table(r) for r in requests]
        for st, n in zip(states, upto):
            need = -(-n // self.block_size) - len(st.blocks)
            if need > len(self.free_blocks):
                first = self._num_slots() // self.block_size
                more = max(need - len(self.free_blocks), first, 16)  # doubling: few copies of the pool
                self._grow(more * self.block_size)
                self.free_blocks.extend(range(first + more - 1, first - 1, -1))
            for _ in range(max(0, need)):
                st.blocks.append(self.free_blocks.pop())
        return [st.blocks for st in states]

    def finish(self, req, st, completed):
        self.free_blocks.extend(st.blocks)
        st.blocks = []

    @torch.inference_mode()
    def _forward(self, kind, hidden, tokens, positions, q_lens, ctx_lens, tables, reads=None):
        """reads (trees): per sequence, the slot where its tree starts and the [rows, tree slots] bool mask of what
        its rows read there (every row reads all slots before)."""
        meta = build_attention_metadata(q_lens, ctx_lens, tables, self.block_size, self.device)
        if reads is not None:
            mask = torch.zeros(len(q_lens), 1, max(q_lens), max(ctx_lens), dtype=torch.bool)
            for b, (start, cols) in enumerate(reads):
                mask[b, 0, :, :start] = True
                mask[b, 0, : cols.shape[0], start : start + cols.shape[1]] = cols
            meta.mask, meta.is_causal = mask.to(self.device), False
        emb = F.embedding(torch.tensor(tokens, device=self.device), self.embed_weight)
        args = (hidden, emb, torch.tensor(positions, device=self.device), self.kv[0], self.kv[1], meta)
        if self.plugins is None:
            return self.head(*args)
        return self.plugins.forward(Step(kind, len(tokens), len(q_lens), "draft_head", tree=reads is not None),
                                    self.head, *args)

    @torch.inference_mode()
    def propose(self, requests, ks, states):
        feats, tokens, positions, q_lens, ctx_lens, last_rows = [], [], [], [], [], []
        t = 0
        for r, st in zip(requests, states):
            n_tok = r.num_tokens
            dc = st.computed
            n = n_tok - 1 - dc  # positions dc..n_tok-2 take (f_p, token p+1)
            assert st.features is not None and st.features.shape[0] == n, "draft features out of sync"
            feats.append(st.features)
            tokens.extend(r.all_ids[dc + 1 : n_tok])
            positions.extend(range(dc, n_tok - 1))
            q_lens.append(n)
            ctx_lens.append(n_tok - 1)
            t += n
            last_rows.append(t - 1)
            st.features = None
        # the chain's d_j enters at position num_tokens - 2 + j (a tree's expanded nodes take one slot each)
        tables = self._tables(requests, states, [r.num_tokens - 1 + max(k, self.tree) for r, k in zip(requests, ks)])
        feats = torch.cat(feats).to(self.head.fc.weight.dtype)
        fused = self._fused(requests, tables, ks, feats, tokens, positions, q_lens)
        if fused is not None:
            return [Draft(d) for d in fused]
        hidden = self.head.fuse(feats)
        logits, out = self._forward(StepKind.DRAFT_EXTEND, hidden, tokens, positions, q_lens, ctx_lens, tables)
        rows = torch.tensor(last_rows, device=self.device)
        logits, g = logits[rows].float(), out[rows]
        if self.tree:
            return self._trees(requests, tables, ks, logits, g)
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = [i for i in range(len(requests)) if ks[i] > 0]
        sel = torch.tensor(active, dtype=torch.long, device=self.device)
        logits, g, j = logits[sel], g[sel], 0
        chained = self._chain(requests, tables, active, ks, logits, g)
        if chained is not None:
            for i, d in zip(active, chained):
                drafts[i] = d
            return [Draft(d) for d in drafts]
        while active:
            for row, i in zip(logits, active):
                params = requests[i].params
                if params.greedy:
                    drafts[i].append(int(self.head.d2t[row.argmax()]))
                else:
                    p = torch.zeros(self.vocab, device=self.device)
                    p[self.head.d2t] = processed_probs(row[None], [params])[0]
                    drafts[i].append(int(sample_from_probs(p[None], [requests[i].generator])[0]))
                    probs[i].append(p)
            j += 1
            keep = [n for n, i in enumerate(active) if ks[i] > j]
            if not keep:
                break
            active = [active[n] for n in keep]
            g = g[torch.tensor(keep, device=self.device)]
            reqs = [requests[i] for i in active]
            pos = [r.num_tokens - 2 + j for r in reqs]  # d_j enters at position num_tokens - 2 + j
            logits, g = self._forward(StepKind.DRAFT, g, [drafts[i][-1] for i in active], pos, [1] * len(active),
                                      [p + 1 for p in pos], [tables[i] for i in active])
            logits = logits.float()
        return [Draft(d, torch.stack(p) if p else None) for d, p in zip(drafts, probs)]

    def _trees(self, requests, tables, ks, logits, g):
        """EAGLE-2 draft trees (class docstring) from the extend step's last rows: logits [B, draft vocab], g [B, h]
        -> [Draft with parents]. The e-th expanded node of a request writes its KV at slot
        num_tokens - 1 + e and reads the context and its expanded ancestors."""
        K, B = self.TREE_TOPK, len(requests)
        depth = [min(k, self.depth, draft_room(r)) for r, k in zip(requests, ks)]
        # per request, per node: draft id, parent node, path log-probability, depth, the hidden it is fed with
        tok, par, score, dep, src = ([[] for _ in range(B)] for _ in range(5))
        slot: list[dict[int, int]] = [{} for _ in range(B)]  # expanded node -> its slot offset

        def add_children(i, parent, row_logits, hidden, d):
            logq = row_logits.float().log_softmax(-1).topk(K)
            base = score[i][parent] if parent >= 0 else 0.0
            for v, t in zip(logq.values.tolist(), logq.indices.tolist()):
                for column, value in ((tok, t), (par, parent), (score, base + v), (dep, d), (src, hidden)):
                    column[i].append(value)

        for i in range(B):
            if depth[i] > 0:
                add_children(i, -1, logits[i], g[i], 1)
        for d in range(1, max(depth, default=0)):
            rows, seqs = [], []  # (request, node) expanded at this depth
            for i in range(B):
                level = [n for n in range(len(tok[i])) if dep[i][n] == d]
                room = self.tree - 1 - len(slot[i])  # expanded nodes stay within the tree's reserved slots
                if d >= depth[i] or room <= 0:
                    continue
                level = sorted(level, key=lambda n: -score[i][n])[: min(K, room)]
                for n in level:
                    slot[i][n] = len(slot[i])
                rows.extend((i, n) for n in level)
                seqs.append((i, level))
            if not rows:
                break
            q_lens, ctx_lens, reads, positions = [], [], [], []
            for i, level in seqs:
                base = requests[i].num_tokens - 1
                q_lens.append(len(level))
                ctx_lens.append(base + len(slot[i]))
                mask = torch.zeros(len(level), len(slot[i]), dtype=torch.bool)
                for row, n in enumerate(level):
                    a = n
                    while a >= 0:  # the node and its ancestors (all expanded)
                        mask[row, slot[i][a]] = True
                        a = par[i][a]
                reads.append((base, mask))
                positions.extend([requests[i].num_tokens - 2 + d] * len(level))
            hidden = torch.stack([src[i][n] for i, n in rows])
            ids = self.head.d2t[torch.tensor([tok[i][n] for i, n in rows], device=self.device)].tolist()
            out_logits, out = self._forward(StepKind.DRAFT, hidden, ids, positions, q_lens, ctx_lens,
                                            [tables[i] for i, _ in seqs], reads)
            for r, (i, n) in enumerate(rows):
                add_children(i, n, out_logits[r], out[r], d + 1)
        drafts = []
        for i in range(B):
            # a parent is at least as likely as its child and shallower: the top nodes are closed under parents
            keep = sorted(range(len(tok[i])), key=lambda n: (-score[i][n], dep[i][n]))[: self.tree]
            keep.sort()  # creation order: parents first
            index = {n: j for j, n in enumerate(keep)}
            ids = self.head.d2t[torch.tensor([tok[i][n] for n in keep], dtype=torch.long, device=self.device)]
            drafts.append(Draft(ids.tolist(), parents=[index[par[i][n]] if par[i][n] >= 0 else -1 for n in keep]))
        return drafts

    def _fused(self, requests, tables, ks, feats, tokens, positions, q_lens):
        """All greedy with one k >= 1 and no tree: a plugin may run the fusion, the draft-extend and the chain in
        one call (drafting with no Python between its parts). Returns each request's draft, or None."""
        k = ks[0]
        if self.plugins is None or self.tree or k < 1 or any(x != k for x in ks) or \
                not all(r.params.greedy for r in requests):
            return None
        out = self.plugins.draft_chain(Step(StepKind.DRAFT, len(requests), len(requests), "draft_head"), self.head,
                                       self.embed_weight, feats, torch.tensor(tokens), torch.tensor(positions),
                                       q_lens, k, self.kv[0], self.kv[1], tables, self.block_size,
                                       method="draft_propose")
        return None if out is None else out.tolist()

    def _chain(self, requests, tables, active, ks, logits, g):
        """All greedy with one k: a plugin may run the k - 1 chained draft steps in one call (same tokens, no Python
        between steps). Returns the drafts of the active rows, or None to run the chain step by step."""
        k = ks[active[0]] if active else 0
        if self.plugins is None or k < 2 or any(ks[i] != k or not requests[i].params.greedy for i in active):
            return None
        first = self.head.d2t[logits.argmax(-1)]
        pos = torch.tensor([requests[i].num_tokens - 1 for i in active], device=self.device)  # where d_1 enters
        rest = self.plugins.draft_chain(Step(StepKind.DRAFT, len(active), len(active), "draft_head"), self.head,
                                        self.embed_weight, g, first, pos, k - 1, self.kv[0], self.kv[1],
                                        [tables[i] for i in active], self.block_size)
        if rest is None:
            return None
        return [[int(f)] + r for f, r in zip(first.tolist(), rest.tolist())]

    def after_verify(self, req, st, num_proposed, num_accepted, tokens_before):
        # chain positions used the head's own hidden states, not the target's: re-extend them with true features
        st.computed = tokens_before - 1
