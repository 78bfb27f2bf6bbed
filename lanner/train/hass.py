"""HASS-style distillation of an EAGLE-3-style draft head.

- Training-time test (TTT): step 0 feeds the target's fused features; step j feeds the head's own output of
  step j-1 from the previous position, exactly as the inference chain does.
- Harmonized context alignment: at step j the query at position p attends to the target-feature keys of
  positions <= p - j and to the keys the head itself produced at steps 1..j for the j most recent positions
  (the diagonal p - j + i at step i) - the context the head really sees at its j-th chained proposal.
- Top-K distillation: the loss is the cross-entropy against the target's top-K probabilities (renormalized
  over those the draft vocabulary holds), not against the one sampled token.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from lanner.bench.report import charts_or_warning, pyplot
from lanner.layers.attention import build_attention_metadata
from lanner.spec.draft_head import DraftHead, DraftHeadConfig


@dataclass
class TrainConfig:
    ttt_steps: int = 4  # chained steps trained (the head is served with up to ~5)
    topk: int = 10
    draft_vocab_size: int = 4096
    max_len: int = 768  # tokens per training sequence (prompt + response, truncated)
    epochs: int = 2
    lr: float = 5e-4
    warmup_steps: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    grad_accum: int = 4
    step_decay: float = 0.8  # loss weight of TTT step j is decay**j
    checkpoint_every: int = 200  # optimizer steps
    bf16: bool = False  # bfloat16 autocast of the head's matmuls (weights, optimizer, loss stay float32): 2.3x
    # tokens/s on a CPU with AVX512-BF16
    pack_tokens: int = 0  # > 0: sequences packed into forwards of up to this many tokens (grad_accum counts packs)
    seed: int = 0


# ---------------------------------------------------------------- target features

@torch.no_grad()  # not inference_mode: the features become inputs of the head's autograd graph
def target_features(model, ids: list[int], layers: list[int], topk: int, block_size: int = 16):
    """One causal forward of the target over `ids` -> (features [T, 3h], top-k ids [T, K], top-k probs [T, K])."""
    cfg = model.cfg
    T = len(ids)
    nb = -(-T // block_size)
    pool = torch.zeros(2, nb * block_size, cfg.num_kv_heads, cfg.head_dim, dtype=model.embed_tokens.weight.dtype,
                       device=model.embed_tokens.weight.device)
    caches = [(pool[0], pool[1])] * cfg.num_layers  # layers run one after another: one scratch pool suffices
    meta = build_attention_metadata([T], [T], [list(range(nb))], block_size, pool.device)
    dev = pool.device
    hidden, captured = model(torch.tensor(ids, device=dev), torch.arange(T, device=dev), caches, meta, tuple(layers))
    probs = model.compute_logits(hidden).float().softmax(-1)
    top_p, top_i = probs.topk(topk, dim=-1)
    return torch.cat(captured, dim=-1).cpu(), top_i.int().cpu(), top_p.half().cpu()


def training_rows(sequences: list[dict], max_len: int) -> list[tuple[list[int], int]]:
    """(prompt + response ids cut to max_len, prompt length) of the sequences with at least 4 response tokens
    left: the rows features are computed for and training runs over."""
    rows = []
    for s in sequences:
        ids = (s["prompt_ids"] + s["output_ids"])[:max_len]
        if len(ids) - len(s["prompt_ids"]) >= 4:
            rows.append((ids, len(s["prompt_ids"])))
    return rows


def feature_cache_dir(data_dir: str, model: str, layers: list[int], topk: int, max_len: int, dtype) -> str:
    """<data_dir>/features-<hash>: one folder per target, feature layers, top-K, length cap and the dtype the
    target ran in (all change the stored values)."""
    key = json.dumps([model, list(layers), topk, max_len, str(dtype)])
    return os.path.join(data_dir, "features-" + hashlib.sha1(key.encode()).hexdigest()[:12])


def _read_shard(path: str, rows: list[tuple[list[int], int]]):
    """The shard's sequences if it holds exactly `rows` (same ids, same prompt lengths), else None."""
    from safetensors.torch import load_file

    if not os.path.exists(path):
        return None
    t = load_file(path)
    lengths, plens = t["lengths"].tolist(), t["plens"].tolist()
    if plens != [p for _, p in rows] or lengths != [len(i) for i, _ in rows] or \
            t["ids"].tolist() != [x for i, _ in rows for x in i]:
        return None  # another data set or length cap wrote it: recompute
    out, a = [], 0
    for L, p in zip(lengths, plens):
        out.append((t["feats"][a : a + L], t["ids"][a : a + L].long(), t["top_i"][a : a + L], t["top_p"][a : a + L], p))
        a += L
    return out


def cached_features(target, rows: list[tuple[list[int], int]], folder: str, layers: list[int], topk: int,
                    shard_size: int = 64, desc: str = "target features") -> list[tuple]:
    """Target features of `rows` ((ids, prompt length), see training_rows), computed once and kept in `folder`
    as safetensors shards of `shard_size` consecutive rows (feature_shard). Shards already written for the
    same rows are read back, so an interrupted run resumes and later runs (train-curve) reuse them.
    Returns [(features [T, 3h] bf16, ids [T] long, top-K ids [T, K] int32, top-K probs [T, K] fp16, prompt len)]."""
    out = []
    bar = tqdm(total=len(rows), desc=desc, unit="seq")
    for s0 in range(0, len(rows), shard_size):
        out.extend(feature_shard(target, rows[s0 : s0 + shard_size], folder, s0 // shard_size, layers, topk,
                                 lambda: bar.update(1)))
        bar.n = len(out)
        bar.refresh()
    bar.close()
    return out


def feature_shard(target, chunk: list[tuple[list[int], int]], folder: str, index: int, layers: list[int],
                  topk: int, on_row=None) -> list[tuple]:
    """One shard of cached_features: read back if `folder` holds it for exactly these rows, else computed and
    written (features bfloat16, which the head is insensitive to: lanner eval-head; top-K ids int32, top-K
    probabilities float16). on_row() is called after each computed row (progress)."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    # named by content: runs over other rows (a subset, another length cap) add shards, never overwrite
    digest = hashlib.sha1(json.dumps(chunk).encode()).hexdigest()[:16]
    path = os.path.join(folder, f"shard-{index:05d}-{digest}.safetensors")
    got = _read_shard(path, chunk)
    if got is not None:
        return got
    got = []
    for ids, plen in chunk:
        f, ti, tp = target_features(target, ids, layers, topk)
        got.append((f.to(torch.bfloat16), torch.tensor(ids), ti, tp, plen))
        if on_row:
            on_row()
    tensors = {"feats": torch.cat([g[0] for g in got]), "ids": torch.cat([g[1] for g in got]).int(),
               "top_i": torch.cat([g[2] for g in got]), "top_p": torch.cat([g[3] for g in got]),
               "lengths": torch.tensor([len(i) for i, _ in chunk]), "plens": torch.tensor([p for _, p in chunk])}
    save_file({k: v.contiguous() for k, v in tensors.items()}, path + ".tmp")
    os.replace(path + ".tmp", path)  # a shard is whole or absent, even if the run is killed mid-write
    return got


def pack_batches(lengths: list[int], order: list[int], pack_tokens: int) -> list[list[int]]:
    """`order` cut into consecutive groups of at most pack_tokens tokens (a longer sequence goes alone);
    pack_tokens <= 0: one sequence per batch."""
    if pack_tokens <= 0:
        return [[i] for i in order]
    packs, cur, size = [], [], 0
    for i in order:
        if cur and size + lengths[i] > pack_tokens:
            packs.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += lengths[i]
    if cur:
        packs.append(cur)
    return packs


def collate(items: list[tuple], device) -> tuple:
    """Cached sequences -> (features float32, ids, top-K ids, top-K probs, lengths, prompt lengths), end to end."""
    cat = (lambda xs: xs[0] if len(xs) == 1 else torch.cat(xs))
    return (cat([x[0] for x in items]).to(device).float(), cat([x[1] for x in items]).to(device),
            cat([x[2] for x in items]).to(device), cat([x[3] for x in items]).to(device),
            [len(x[1]) for x in items], [x[4] for x in items])


def draft_vocabulary(sequences: list[dict], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent target tokens of the responses (what the head must predict), by frequency."""
    counts = Counter()
    for s in sequences:
        counts.update(s["output_ids"])
    ids = [t for t, _ in counts.most_common(size)]
    if len(ids) < size:  # small data: fill with the lowest ids not yet present (stable, deterministic)
        have = set(ids)
        ids += [t for t in range(vocab_size) if t not in have][: size - len(ids)]
    return torch.tensor(ids, dtype=torch.long)


# ---------------------------------------------------------------- the TTT forward

def _pack_index(lengths: list[int], device):
    """Head rows of sequences of `lengths` laid end to end (sequence i holds L_i - 1 rows): per row its position
    within its sequence (RoPE restarts), its flat index into the concatenated features / ids (feature row `cur`,
    token row `cur + 1`), and the first row of each sequence."""
    n = torch.tensor([L - 1 for L in lengths], device=device)
    starts = torch.cumsum(n, 0) - n  # first head row of each sequence
    offsets = torch.cumsum(torch.tensor(lengths, device=device), 0) - torch.tensor(lengths, device=device)
    seg = torch.repeat_interleave(torch.arange(len(lengths), device=device), n)
    pos = torch.arange(int(n.sum()), device=device) - starts[seg]
    return pos, offsets[seg] + pos, starts, n


def _ttt_mask(n: int, j: int, device) -> torch.Tensor:
    """Step j of one sequence of n head rows: query p reads the target-context keys q' <= p - j, then the head's
    own keys from steps 1..j on the diagonal p - j + i; rows with no key (p < j, no loss) read key 0."""
    pos = torch.arange(n, device=device)
    qi = pos[:, None]
    mask = torch.cat([pos[None, :] <= qi - j] + [pos[None, :] == qi - j + i for i in range(1, j + 1)], dim=1)
    mask[:, 0] |= ~mask.any(1)
    return mask


def ttt_forward(head: DraftHead, embed, feats, ids, steps: int, lengths: list[int] | None = None):
    """Yields, for TTT steps j = 0..steps-1, the head's draft-vocabulary logits [n, Vd] at every position
    p = 0..n-1 (n = T-1): step j at p is the j-th chained proposal of a chain started at p - j, i.e. the
    prediction of ids[p + 2] that inference makes j steps after the target's features at p - j.

    lengths (packing): feats and ids hold several sequences end to end, of these lengths; the logits are then the
    sequences' rows end to end (L_i - 1 each), each sequence exactly as if run alone. The linear layers (the bulk
    of the work) run on all rows at once; attention is block-diagonal, computed block by block (a dense mask over
    the whole pack would make its cost quadratic in the pack size instead of in the sequence length)."""
    lengths = [ids.shape[0]] if lengths is None else list(lengths)
    pos, cur, starts, n_rows = _pack_index(lengths, ids.device)
    tok_emb = embed(ids[cur + 1])
    hidden = head.fuse(feats[cur])
    sizes = n_rows.tolist()
    masks = {}
    keys, values = [[] for _ in range(head.cfg.num_layers)], [[] for _ in range(head.cfg.num_layers)]
    rope = head.rotary.lookup(pos, hidden.dtype) if len(head.layers) else None

    def attend(layer: int, j: int, q, k, v):
        keys[layer].append(k)
        values[layer].append(v)
        parts, a = [], 0
        for n in sizes:
            if (n, j) not in masks:
                masks[n, j] = _ttt_mask(n, j, ids.device)
            # this sequence's keys of every step so far, step-major as the mask's columns
            ks = torch.cat([kk[a : a + n] for kk in keys[layer]]).transpose(0, 1)[None]
            vs = torch.cat([vv[a : a + n] for vv in values[layer]]).transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(q[a : a + n].transpose(0, 1)[None], ks, vs,
                                               attn_mask=masks[n, j][None, None], scale=head.scale, enable_gqa=True)
            parts.append(o[0].transpose(0, 1).reshape(n, -1))
            a += n
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    out = None
    for j in range(steps):
        if j > 0:  # the head's own output at p-1 stands in for the target features at p (zero at each p = 0)
            hidden = torch.cat([hidden.new_zeros(1, hidden.shape[1]), out[:-1]], dim=0)
            if len(sizes) > 1:
                hidden = hidden.index_fill(0, starts, 0.0)
        out = head.first_layer_out(hidden, attend(0, j, *head.qkv(hidden, tok_emb, pos)))
        for i, layer in enumerate(head.layers, 1):  # deeper heads: the same mask per layer
            out = layer.post(out, attend(i, j, *layer.qkv(out, *rope)))
        yield head.logits(out)


def ttt_losses(head: DraftHead, embed, feats, ids, top_i, top_p, t2d, loss_from, steps: int, decay: float,
               lengths: list[int] | None = None, objective: str = "kl", lk_kl_weight: float = 0.1):
    """feats [T, 3h] (target, positions 0..T-1), ids [T], top_i/top_p [T, K] (target distribution of the token
    after each position). Returns (total loss, per-step losses, per-step top-1 accuracy).

    lengths (packing, see ttt_forward): several sequences end to end, loss_from a list (each one's prompt
    length). Then total is the sum of the sequences' own totals (divide by their number for the mean a loop over
    them gives), and per step the losses and accuracies are lists, one value per sequence.

    objective "kl": the top-K cross-entropy (HASS). "lk": a direct acceptance objective in the manner of LK losses
    (Samarin et al. 2026): -log alpha, alpha = sum_x min(p(x), q(x)) the speculative-sampling acceptance
    probability of the row (p: the target's top-K renormalized over the draft vocabulary), plus lk_kl_weight
    times the top-K cross-entropy, which keeps a gradient on rows whose alpha is ~0 (min() passes none to the
    tokens where q already exceeds p). "greedy": the same for greedy verification, where a draft token is kept
    only if it is the target's top-1: -log q(top-1), plus lk_kl_weight times the top-K cross-entropy (alone on
    rows whose top-1 is outside the draft vocabulary, which can never be accepted)."""
    if objective not in ("kl", "lk", "greedy"):
        raise ValueError(f"objective: must be 'kl', 'lk' or 'greedy', got {objective!r}")
    packed = lengths is not None
    lengths = [ids.shape[0]] if lengths is None else list(lengths)
    loss_from = list(loss_from) if packed else [loss_from]
    S = len(lengths)
    pos, cur, _, n_rows = _pack_index(lengths, ids.device)
    # head row p takes (f_p, x_{p+1}) and predicts x_{p+2} ~ the target distribution at p+1: restricted to the
    # draft vocabulary and renormalized
    d_ids = t2d[top_i[cur + 1].long()]  # [N, K] draft ids, -1 where the draft vocabulary lacks the token
    best = d_ids[:, 0]  # the target's top-1 (-1 when outside the draft vocabulary: never matched)
    w = top_p[cur + 1].float() * (d_ids >= 0)
    w_sum = w.sum(-1, keepdim=True)
    seg = torch.repeat_interleave(torch.arange(S, device=ids.device), n_rows)
    lf = torch.tensor(loss_from, device=ids.device)[seg]
    valid = (w_sum[:, 0] > 0) & (pos >= lf - 2)  # only positions that predict response tokens
    w = w / w_sum.clamp_min(1e-9)
    d_ids = d_ids.clamp_min(0)
    total, step_losses, step_acc = 0.0, [], []
    for j, logits in enumerate(ttt_forward(head, embed, feats, ids, steps, lengths if packed else None)):
        logp = logits.float().log_softmax(-1)
        ok = (valid & (pos >= j)).float()
        q = logp.gather(-1, d_ids)
        loss_rows = -(w * q).sum(-1)
        if objective == "lk":
            alpha = torch.minimum(w, q.exp()).sum(-1)
            loss_rows = -alpha.clamp_min(1e-6).log() + lk_kl_weight * loss_rows
        elif objective == "greedy":
            loss_rows = -q[:, 0] * (best >= 0) + lk_kl_weight * loss_rows
        count = torch.zeros(S, device=ids.device).index_add_(0, seg, ok).clamp_min(1)
        loss = torch.zeros(S, device=ids.device).index_add_(0, seg, loss_rows * ok) / count  # per sequence
        hit = torch.zeros(S, device=ids.device).index_add_(0, seg, (logp.argmax(-1) == best).float() * ok) / count
        total = total + (decay ** j) * loss.sum()
        step_losses.append(loss.tolist() if packed else loss.item())
        step_acc.append(hit.tolist() if packed else float(hit[0]))
    return total, step_losses, step_acc


# ---------------------------------------------------------------- training loop

def load_train_state(out_dir: str, head, opt, resume: bool, log=print) -> tuple[int, list, int, int]:
    """(optimizer step, history, epoch, index within the epoch) from out_dir/train_state.pt when resuming,
    else a fresh start; loads the head and optimizer state in place."""
    path = os.path.join(out_dir, "train_state.pt")
    if not (resume and os.path.exists(path)):
        return 0, [], 0, 0
    st = torch.load(path, weights_only=False)
    head.load_state_dict(st["head"])
    opt.load_state_dict(st["opt"])
    log(f"resumed at optimizer step {st['step']} (epoch {st['epoch']}, item {st['index']})")
    return st["step"], st["history"], st["epoch"], st["index"]


def save_train_state(out_dir: str, head, opt, step: int, history: list, epoch: int, index: int, cfg):
    torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": step, "history": history,
                "epoch": epoch, "index": index, "config": asdict(cfg)}, os.path.join(out_dir, "train_state.pt"))


def new_head(target, sequences: list[dict], draft_vocab_size: int, intermediate_size: int | None = None,
             num_layers: int = 1) -> DraftHead:
    """A fresh float32 head for `target` on its device: draft vocabulary = the most frequent response tokens,
    final norm and output rows copied from the target; intermediate_size: the MLP width (default the target's)."""
    tcfg = target.cfg
    device = target.embed_tokens.weight.device
    hcfg = DraftHeadConfig.for_target(tcfg, draft_vocab_size)
    if intermediate_size:
        hcfg.intermediate_size = intermediate_size
    hcfg.num_layers = num_layers
    d2t = draft_vocabulary(sequences, hcfg.draft_vocab_size, tcfg.vocab_size)
    head = DraftHead(hcfg)
    with torch.no_grad():
        head.d2t.copy_(d2t)
        head.norm.weight.copy_(target.norm.weight.float())
        lm = target.embed_tokens.weight if target.lm_head is None else target.lm_head.weight
        head.lm_head.weight.copy_(lm[d2t].float())
    head = head.to(device)
    head.init_rotary(device)
    return head


def widen_draft_vocabulary(head: DraftHead, target, sequences: list[dict], size: int) -> DraftHead:
    """`head` with its draft vocabulary grown to `size`: the most frequent response tokens it lacks are appended
    with zero output rows, learned by the training that follows. (The target's rows, as new_head starts, outvote
    the trained ones: a trained head's step-0 top-1 agreement fell from 0.55 to 0.02 with them, to 0.51 with
    zeros.) The trained rows and ids stay as they were."""
    have = set(head.d2t.tolist())
    add = [t for t in draft_vocabulary(sequences, size + len(have), target.cfg.vocab_size).tolist()
           if t not in have][: size - len(have)]
    if not add:
        return head
    old = head.lm_head.weight.detach()
    head.cfg.draft_vocab_size = len(head.d2t) + len(add)
    head.lm_head = torch.nn.Linear(old.shape[1], head.cfg.draft_vocab_size, bias=False, device=old.device,
                                   dtype=old.dtype)
    with torch.no_grad():
        head.lm_head.weight.zero_()
        head.lm_head.weight[: len(old)] = old
    head.lm_head.weight.requires_grad_(head.norm.weight.requires_grad)
    head.d2t = torch.cat([head.d2t, torch.tensor(add, dtype=torch.long, device=head.d2t.device)])
    return head


def target_to_draft(head: DraftHead, vocab_size: int) -> torch.Tensor:
    """[target vocab] -> draft id, -1 outside the draft vocabulary."""
    t2d = torch.full((vocab_size,), -1, dtype=torch.long, device=head.d2t.device)
    t2d[head.d2t] = torch.arange(len(head.d2t), device=head.d2t.device)
    return t2d


def lr_schedule(cfg: TrainConfig, total_steps: int):
    def lr_at(step):  # linear warmup, cosine decay to 10%
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        prog = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, prog))))
    return lr_at


def train_draft_head(target, sequences: list[dict], out_dir: str, cfg: TrainConfig, resume: bool = True,
                     log=print, init: str | None = None, feature_dir: str | None = None) -> DraftHead:
    """target: the loaded target model (LlamaModel); sequences: [{"prompt_ids", "output_ids"}]; init: a head
    folder to continue from (its draft vocabulary is kept), else a new head started from the target's rows;
    feature_dir: where the target features are stored (cached_features; default out_dir/features)."""
    torch.manual_seed(cfg.seed)
    os.makedirs(out_dir, exist_ok=True)
    # the loss curve is a by-product (training.json keeps its history): without matplotlib (the bench extra) it is
    # skipped with a warning given now, rather than failing the run at its end and losing the training
    plot = charts_or_warning(os.path.join(out_dir, "loss.png"))
    tcfg = target.cfg
    device = target.embed_tokens.weight.device  # the head trains in float32 where the target runs
    if init is not None:
        head = DraftHead.load(init, torch.float32, device).requires_grad_(True)
        hcfg = head.cfg
        if hcfg.target_vocab_size != tcfg.vocab_size or hcfg.hidden_size != tcfg.hidden_size:
            raise ValueError(f"init: the head at {init} was built for another target (vocab "
                             f"{hcfg.target_vocab_size}, hidden {hcfg.hidden_size})")
    else:
        head = new_head(target, sequences, cfg.draft_vocab_size)
        hcfg = head.cfg
    t2d = target_to_draft(head, tcfg.vocab_size)
    embed = torch.nn.Embedding.from_pretrained(target.embed_tokens.weight.float(), freeze=True)

    t0 = time.perf_counter()
    cache = cached_features(target, training_rows(sequences, cfg.max_len),
                            feature_dir or os.path.join(out_dir, "features"), hcfg.feature_layers, cfg.topk)
    feature_s = time.perf_counter() - t0

    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    lengths = [len(c[1]) for c in cache]
    orders = [torch.randperm(len(cache), generator=torch.Generator().manual_seed(cfg.seed + e)).tolist()
              for e in range(cfg.epochs)]
    epoch_batches = [pack_batches(lengths, o, cfg.pack_tokens) for o in orders]
    total_steps = max(1, sum(len(b) for b in epoch_batches) // cfg.grad_accum)
    lr_at = lr_schedule(cfg, total_steps)

    step, history, start_epoch, start_index = load_train_state(out_dir, head, opt, resume, log)

    def checkpoint(epoch, index):
        save_train_state(out_dir, head, opt, step, history, epoch, index, cfg)

    train_tokens = loss_tokens = 0  # tokens through the head (every position of every sequence) / with a loss
    t1 = time.perf_counter()
    head.train()
    for epoch in range(start_epoch, cfg.epochs):
        batches = epoch_batches[epoch]
        bar = tqdm(range(start_index if epoch == start_epoch else 0, len(batches)), desc=f"epoch {epoch + 1}",
                   unit="batch")
        for i in bar:
            f, ids, ti, tp, lens, plens = collate([cache[k] for k in batches[i]], device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
                loss, losses, acc = ttt_losses(head, embed, f, ids, ti, tp, t2d, plens, cfg.ttt_steps,
                                               cfg.step_decay, lengths=lens)
            (loss / (len(lens) * cfg.grad_accum)).backward()  # the mean over sequences, as one at a time gave
            train_tokens += sum(lens)
            loss_tokens += sum(L - p for L, p in zip(lens, plens))
            if (i + 1) % cfg.grad_accum == 0:
                for g in opt.param_groups:
                    g["lr"] = lr_at(step)
                torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                opt.step()
                opt.zero_grad(set_to_none=True)
                step += 1
                mean = [sum(x) / len(x) for x in losses]
                mean_acc = [sum(x) / len(x) for x in acc]
                history.append({"step": step, "loss": loss.item() / len(lens), "step_losses": mean,
                                "step_acc": mean_acc, "lr": lr_at(step - 1)})
                bar.set_postfix(loss=f"{loss.item() / len(lens):.3f}", acc0=f"{mean_acc[0]:.2f}",
                                accK=f"{mean_acc[-1]:.2f}",
                                tok_s=f"{train_tokens / (time.perf_counter() - t1):.0f}")
                if step % cfg.checkpoint_every == 0:
                    checkpoint(epoch, i + 1)
        start_index = 0
    checkpoint(cfg.epochs, 0)
    head.eval()
    head.save(out_dir)
    train_s = time.perf_counter() - t1
    cost = {"feature_s": feature_s, "train_s": train_s, "sequences": len(cache),
            "train_tokens_seen": loss_tokens, "train_tokens_processed": train_tokens,
            "train_tokens_per_s": train_tokens / max(train_s, 1e-9), "optimizer_steps": step,
            "config": asdict(cfg), "init": init, "device": str(device), "threads": torch.get_num_threads()}
    with open(os.path.join(out_dir, "training.json"), "w") as fh:
        json.dump({"cost": cost, "history": history}, fh)
    if plot:
        plot_history(history, os.path.join(out_dir, "loss.png"))
    return head


def plot_history(history: list[dict], path: str):
    plt = pyplot()
    if not history:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    steps = [h["step"] for h in history]
    k = len(history[0]["step_losses"])
    for j in range(k):
        a.plot(steps, [h["step_losses"][j] for h in history], label=f"TTT step {j}", lw=1)
        b.plot(steps, [h["step_acc"][j] for h in history], label=f"TTT step {j}", lw=1)
    a.set(xlabel="optimizer step", ylabel="top-K distillation loss", title="loss")
    b.set(xlabel="optimizer step", ylabel="top-1 agreement with the target", title="accuracy")
    a.legend()
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
