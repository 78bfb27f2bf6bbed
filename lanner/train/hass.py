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

import json
import math
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

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

def ttt_forward(head: DraftHead, embed, feats, ids, steps: int):
    """Yields, for TTT steps j = 0..steps-1, the head's draft-vocabulary logits [n, Vd] at every position
    p = 0..n-1 (n = T-1): step j at p is the j-th chained proposal of a chain started at p - j, i.e. the
    prediction of ids[p + 2] that inference makes j steps after the target's features at p - j."""
    n = ids.shape[0] - 1
    pos = torch.arange(n, device=ids.device)
    tok_emb = embed(ids[1:])
    hidden = head.fuse(feats[:n])
    keys, values, out = [], [], None
    for j in range(steps):
        if j > 0:  # the head's own output at p-1 stands in for the target features at p
            hidden = torch.cat([hidden.new_zeros(1, hidden.shape[1]), out[:-1]], dim=0)
        q, k, v = head.qkv(hidden, tok_emb, pos)
        keys.append(k)
        values.append(v)
        # step j, query p: target-context keys q' <= p - j, then the head's own keys from steps 1..j on the
        # diagonal p - j + i
        qi = pos[:, None]
        masks = [pos[None, :] <= qi - j] + [pos[None, :] == qi - j + i for i in range(1, j + 1)]
        mask = torch.cat(masks, dim=1)
        mask[:, 0] |= ~mask.any(1)  # rows with no key (p < j) attend to something; they carry no loss
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], torch.cat(keys).transpose(0, 1)[None], torch.cat(values).transpose(0, 1)[None],
            attn_mask=mask[None, None], scale=head.scale, enable_gqa=True)
        attn = attn[0].transpose(0, 1).reshape(n, -1)
        logits, out = head.post(hidden, attn)
        yield logits


def ttt_losses(head: DraftHead, embed, feats, ids, top_i, top_p, t2d, loss_from: int, steps: int, decay: float):
    """feats [T, 3h] (target, positions 0..T-1), ids [T], top_i/top_p [T, K] (target distribution of the token
    after each position). Returns (total loss, per-step losses, per-step top-1 accuracy)."""
    T = ids.shape[0]
    n = T - 1  # head positions p = 0..T-2 take (f_p, x_{p+1}) and predict x_{p+2} ~ target distribution at p+1
    pos = torch.arange(n, device=ids.device)
    # target distribution at p+1, restricted to the draft vocabulary and renormalized
    d_ids = t2d[top_i[1:].long()]  # [n, K] draft ids, -1 where the draft vocabulary lacks the token
    best = d_ids[:, 0]  # the target's top-1 (-1 when outside the draft vocabulary: never matched)
    w = top_p[1:].float() * (d_ids >= 0)
    w_sum = w.sum(-1, keepdim=True)
    valid = (w_sum[:, 0] > 0) & (pos >= loss_from - 2)  # only positions that predict response tokens
    w = w / w_sum.clamp_min(1e-9)
    d_ids = d_ids.clamp_min(0)
    total, step_losses, step_acc = 0.0, [], []
    for j, logits in enumerate(ttt_forward(head, embed, feats, ids, steps)):
        logp = logits.float().log_softmax(-1)
        ok = valid & (pos >= j)
        loss_rows = -(w * logp.gather(-1, d_ids)).sum(-1)
        loss = (loss_rows * ok).sum() / ok.sum().clamp_min(1)
        total = total + (decay ** j) * loss
        step_losses.append(loss.item())
        step_acc.append(float(((logp.argmax(-1) == best) & ok).sum() / ok.sum().clamp_min(1)))
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


def train_draft_head(target, sequences: list[dict], out_dir: str, cfg: TrainConfig, resume: bool = True,
                     log=print, init: str | None = None) -> DraftHead:
    """target: the loaded target model (LlamaModel); sequences: [{"prompt_ids", "output_ids"}]; init: a head
    folder to continue from (its draft vocabulary is kept), else a new head started from the target's rows."""
    torch.manual_seed(cfg.seed)
    os.makedirs(out_dir, exist_ok=True)
    tcfg = target.cfg
    device = target.embed_tokens.weight.device  # the head trains in float32 where the target runs
    if init is not None:
        head = DraftHead.load(init, torch.float32, device).requires_grad_(True)
        hcfg, d2t = head.cfg, head.d2t.clone()
        if hcfg.target_vocab_size != tcfg.vocab_size or hcfg.hidden_size != tcfg.hidden_size:
            raise ValueError(f"init: the head at {init} was built for another target (vocab "
                             f"{hcfg.target_vocab_size}, hidden {hcfg.hidden_size})")
    else:
        hcfg = DraftHeadConfig.for_target(tcfg, cfg.draft_vocab_size)
        d2t = draft_vocabulary(sequences, hcfg.draft_vocab_size, tcfg.vocab_size)
        head = DraftHead(hcfg)
        with torch.no_grad():
            head.d2t.copy_(d2t)
            # start from the target: final norm and the target's output rows of the draft vocabulary
            head.norm.weight.copy_(target.norm.weight.float())
            lm = target.embed_tokens.weight if target.lm_head is None else target.lm_head.weight
            head.lm_head.weight.copy_(lm[d2t].float())
        head = head.to(device)
        head.init_rotary(device)
    t2d = torch.full((tcfg.vocab_size,), -1, dtype=torch.long)
    t2d[d2t.cpu()] = torch.arange(len(d2t))
    t2d = t2d.to(device)
    embed = torch.nn.Embedding.from_pretrained(target.embed_tokens.weight.float(), freeze=True)

    t0 = time.perf_counter()
    cache = []
    for s in tqdm(sequences, desc="target features", unit="seq"):
        ids = (s["prompt_ids"] + s["output_ids"])[: cfg.max_len]
        if len(ids) - len(s["prompt_ids"]) < 4:
            continue
        f, ti, tp = target_features(target, ids, hcfg.feature_layers, cfg.topk)
        cache.append((f, torch.tensor(ids), ti, tp, len(s["prompt_ids"])))
    feature_s = time.perf_counter() - t0

    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    total_steps = max(1, cfg.epochs * len(cache) // cfg.grad_accum)

    def lr_at(step):  # linear warmup, cosine decay to 10%
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        prog = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, prog))))

    step, history, start_epoch, start_index = load_train_state(out_dir, head, opt, resume, log)

    def checkpoint(epoch, index):
        save_train_state(out_dir, head, opt, step, history, epoch, index, cfg)

    train_tokens = 0
    t1 = time.perf_counter()
    head.train()
    for epoch in range(start_epoch, cfg.epochs):
        order = torch.randperm(len(cache), generator=torch.Generator().manual_seed(cfg.seed + epoch)).tolist()
        bar = tqdm(range(start_index if epoch == start_epoch else 0, len(order)), desc=f"epoch {epoch + 1}",
                   unit="seq")
        for i in bar:
            f, ids, ti, tp, plen = (x.to(device) if torch.is_tensor(x) else x for x in cache[order[i]])
            loss, losses, acc = ttt_losses(head, embed, f.float(), ids, ti, tp, t2d, plen, cfg.ttt_steps,
                                           cfg.step_decay)
            (loss / cfg.grad_accum).backward()
            train_tokens += len(ids) - plen
            if (i + 1) % cfg.grad_accum == 0:
                for g in opt.param_groups:
                    g["lr"] = lr_at(step)
                torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                opt.step()
                opt.zero_grad(set_to_none=True)
                step += 1
                history.append({"step": step, "loss": loss.item(), "step_losses": losses, "step_acc": acc,
                                "lr": lr_at(step - 1)})
                bar.set_postfix(loss=f"{loss.item():.3f}", acc0=f"{acc[0]:.2f}", accK=f"{acc[-1]:.2f}")
                if step % cfg.checkpoint_every == 0:
                    checkpoint(epoch, i + 1)
        start_index = 0
    checkpoint(cfg.epochs, 0)
    head.eval()
    head.save(out_dir)
    cost = {"feature_s": feature_s, "train_s": time.perf_counter() - t1, "sequences": len(cache),
            "train_tokens_seen": train_tokens, "optimizer_steps": step, "config": asdict(cfg), "init": init,
            "device": str(target.embed_tokens.weight.device), "threads": torch.get_num_threads()}
    with open(os.path.join(out_dir, "training.json"), "w") as fh:
        json.dump({"cost": cost, "history": history}, fh)
    plot_history(history, os.path.join(out_dir, "loss.png"))
    return head


def plot_history(history: list[dict], path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
