"""lanner train-base: the base draft head, trained long and resumably, on one thread in the background.

HASS distillation (lanner.train.hass) over a stream of rows: ShareGPT conversations of the 90% training split
with their own replies (every turn, up to --max-len tokens) and Python modules of installed packages that no
benchmark reads (--code-share of the rows), shuffled once by --seed. Chunk by chunk the target's features are
computed and stored as shards under --data (a second epoch and a resumed run read them back), and the head
trains on the chunk at once: memory stays at one chunk however long the run, and the learning curve grows while
the features are still being made.

At --first-point tokens and every doubling after it (and at the end), the head is scored on train-curve's
held-out sets (the target's own greedy answers to held-out ShareGPT and MT-Bench prompts): first-token agreement
and replay tau, which equals live tau (docs/draft-heads.md). At each point and every --checkpoint-minutes the
head (servable), training.json (counters, cost, curve) and the full state with the optimizer (train_state.pt) are
written to --out; SIGTERM stops at the next chunk's end, checkpointed. Rerunning the same command resumes: from
train_state.pt, or on another machine from a committed head and its training.json (AdamW then restarts).
Costs are counted in CPU seconds of this process, so a run paused with SIGSTOP (while benchmarks run) reports
what it spent, not the wall time it waited.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import sys
import time

import torch
from tqdm import tqdm

from lanner.bench import report
from lanner.train.data import code_files

HELP = "Train the base draft head long and resumably (streamed features, learning curve, checkpoints)."
DESCRIPTION = __doc__
CHUNK = 64  # rows per feature shard and per training chunk


def add_arguments(p):
    from lanner.train.curve import add_training_arguments

    p.add_argument("--out", required=True, help="folder of the head (config.json, model.safetensors, training.json)")
    p.add_argument("--data", default="data/train-base", help="cache folder: rows, held-out answers, features")
    p.add_argument("--tokens", type=int, default=8_000_000, help="training tokens (all positions) of the whole run")
    p.add_argument("--max-len", type=int, default=1024, help="tokens per training row")
    p.add_argument("--code-share", type=float, default=0.25, help="share of rows that are Python modules")
    p.add_argument("--draft-vocab-size", type=int, default=4096)
    p.add_argument("--width", type=int, default=0, help="the head's MLP width (0: the target's)")
    p.add_argument("--pack-tokens", type=int, default=2048, help="tokens per packed forward (one optimizer step)")
    add_training_arguments(p)
    p.add_argument("--first-point", type=int, default=62_500, help="tokens at the first curve point (then doubling)")
    p.add_argument("--features-ahead", action="store_true",
                   help="only compute the feature shards of the chunks ahead of the --out run (a second process)")
    p.add_argument("--stop-at", type=int, default=0, metavar="TOKENS",
                   help="stop (checkpointed) once this many tokens are seen; the same command continues")
    p.add_argument("--checkpoint-minutes", type=float, default=10.0)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--no-resume", action="store_true", help="start from scratch even if a checkpoint exists")
    p.add_argument("--split-seed", type=int, default=0, help="seed of the ShareGPT 90/10 split")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(dtype="float32")  # the held-out answers and their features: float32 greedy, as train-curve


# ------------------------------------------------------------------ rows

def conversation_rows(tok, ids: set[str], max_len: int) -> list[tuple[list[int], int]]:
    """(ids, prompt length) per ShareGPT conversation in `ids`: its turns while they alternate user / assistant
    (from the first, up to about max_len tokens), ending on an assistant turn; the loss starts after the first
    user turn, so later user turns are learned too (the target's distribution over them is still the label)."""
    from lanner.train.data import sharegpt_records

    eos = tok.eos_token_ids[0] if tok.eos_token_ids else None
    rows, seen = [], set()
    for r in tqdm(sharegpt_records(), desc="conversations", unit="conv"):
        if r["id"] not in ids or r["id"] in seen:
            continue
        seen.add(r["id"])
        msgs, chars = [], 0
        for c in r.get("conversations") or []:
            role = {"human": "user", "gpt": "assistant"}.get(c.get("from"))
            text = (c.get("value") or "").strip()
            if role is None or not text or (msgs and msgs[-1]["role"] == role) or chars > 6 * max_len:
                break
            msgs.append({"role": role, "content": text})
            chars += len(text)
        if msgs and msgs[-1]["role"] == "user":
            msgs.pop()
        if len(msgs) < 2:
            continue
        seq = tok.apply_chat_template(msgs[:-1]) + tok.hf.encode(msgs[-1]["content"], add_special_tokens=False)
        seq = (seq + ([eos] if eos is not None else []))[:max_len]
        plen = len(tok.apply_chat_template(msgs[:1]))
        if len(seq) - plen >= 16:
            rows.append((seq, plen))
    return rows


def code_rows(tok, count: int, max_len: int, seed: int) -> list[tuple[list[int], int]]:
    """`count` rows "Write the Python module <path>." answered by the module's text (its first max_len tokens),
    from CODE_PACKAGES' files of at least 40 lines, picked by `seed`."""
    base, files = code_files(seed)
    eos = tok.eos_token_ids[0] if tok.eos_token_ids else None
    rows = []
    bar = tqdm(total=count, desc="code rows", unit="file")
    for path in files:
        if len(rows) >= count:
            break
        text = path.read_text(errors="replace")
        if text.count("\n") < 40:
            continue
        prompt = tok.apply_chat_template([{"role": "user",
                                           "content": f"Write the Python module {path.relative_to(base)}."}])
        out = tok.hf.encode(text[: 6 * max_len], add_special_tokens=False) + ([eos] if eos is not None else [])
        rows.append(((prompt + out)[:max_len], len(prompt)))
        bar.update(1)
    bar.close()
    return rows


def training_stream(tok, args) -> list[tuple[list[int], int]]:
    """All rows of the run in their training order, built once and cached under --data."""
    from lanner.train.data import split_sharegpt

    key = json.dumps([tok.hf.name_or_path, len(tok.hf), args.max_len, args.code_share, args.split_seed, args.seed])
    path = os.path.join(args.data, "rows-" + hashlib.sha1(key.encode()).hexdigest()[:12] + ".json")
    if os.path.exists(path):
        with open(path) as f:
            return [tuple(r) for r in json.load(f)]
    train, _ = split_sharegpt(args.split_seed)
    rows = conversation_rows(tok, {p["id"] for p in train}, args.max_len)
    rows += code_rows(tok, round(len(rows) * args.code_share / (1 - args.code_share)), args.max_len, args.seed)
    random.Random(args.seed).shuffle(rows)
    os.makedirs(args.data, exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(rows, f)
    os.replace(path + ".tmp", path)
    return rows


# ------------------------------------------------------------------ the run

def _points(first: int, total: int) -> list[int]:
    out = []
    while first < total:
        out.append(first)
        first *= 2
    return out + [total]


def run(args, engine_options: dict) -> dict:
    from lanner.llm import LLM
    from lanner.models.loader import load_config, load_model
    from lanner.spec.draft_head import DraftHeadConfig
    from lanner.train.curve import heldout_answers
    from lanner.train.hass import TrainConfig, cached_features, feature_cache_dir

    torch.set_num_threads(args.threads)
    llm = LLM(**{**engine_options, "spec": None, "draft": None})
    eng, tok = llm.engine, llm.tokenizer
    heldout = heldout_answers(llm, args.heldout, args.max_new_tokens, args.data)
    target = eng.model  # float32: held-out features, the head's embedding and its initial rows
    layers = DraftHeadConfig.for_target(target.cfg).feature_layers
    held = {}
    for name, rows in heldout.items():
        folder = feature_cache_dir(args.data, eng.source.name, layers, 1, 10**9, "heldout-" + name +
                                   str(eng.config.dtype) + str(len(rows)) + str(args.max_new_tokens))
        held[name] = [(f, i.tolist(), p) for f, i, _, _, p in
                      cached_features(target, rows, folder, layers, 1, desc=f"held-out {name} features")]
    stream = training_stream(tok, args)
    ftarget = load_model(eng.source, torch.bfloat16, "cpu", load_config(eng.source))[0]  # 2.4x float32's speed
    folder = feature_cache_dir(args.data, eng.source.name, layers, TrainConfig.topk, args.max_len,
                               torch.bfloat16)
    if args.features_ahead:
        return features_ahead(ftarget, stream, folder, args)
    return train_stream(target, ftarget, stream, held, folder, args, eng.source.name)


def features_ahead(ftarget, stream, folder: str, args) -> dict:
    """--features-ahead: compute the feature shards of the chunks after the training run's next one (read from
    --out's training.json), so that the run, finding them stored, only trains. For a second core while nothing
    is benchmarked; a shard is whole or absent, so the two processes never read a half-written one."""
    from lanner.spec.draft_head import DraftHeadConfig
    from lanner.train.hass import TrainConfig, feature_shard

    layers = DraftHeadConfig.for_target(ftarget.cfg).feature_layers
    chunks = [stream[i : i + CHUNK] for i in range(0, len(stream), CHUNK)]
    record = os.path.join(args.out, "training.json")
    done = 0
    if os.path.exists(record):
        with open(record) as f:
            done = json.load(f).get("state", {}).get("chunk", 0)
    first = done + 2  # the run itself may be computing the next one
    for i in tqdm(range(first, len(chunks)), desc="features ahead", unit="chunk"):
        feature_shard(ftarget, chunks[i], folder, i, layers, TrainConfig.topk)
    return {"chunks": len(chunks) - first}


def train_stream(target, ftarget, stream: list[tuple[list[int], int]], held: dict, folder: str, args,
                 model_name: str) -> dict:
    """Train a new head on `stream` (rows in order; features of `ftarget` stored in `folder`), scoring it on
    `held` ({set: [(features, ids, prompt length)]}) at the curve's points, resuming from args.out's checkpoint.
    Stops at args.tokens, or after the chunk that reaches args.stop_at (checkpointed, to be continued)."""
    from lanner.spec.draft_head import DraftHead, DraftHeadConfig
    from lanner.train.curve import _step
    from lanner.train.eval_head import score_sequences
    from lanner.train.hass import TrainConfig, feature_shard, lr_schedule, new_head, pack_batches, target_to_draft

    cfg = TrainConfig(ttt_steps=args.ttt_steps, lr=args.lr, max_len=args.max_len, grad_accum=1, warmup_steps=20,
                      seed=args.seed, bf16=True, pack_tokens=args.pack_tokens)
    layers = DraftHeadConfig.for_target(target.cfg).feature_layers
    chunks = [stream[i : i + CHUNK] for i in range(0, len(stream), CHUNK)]
    available = sum(len(r[0]) for r in stream)
    print(f"train-base: {len(stream)} rows, {available} tokens ({available / 1e6:.2f}M) in {len(chunks)} chunks; "
          f"{args.tokens / available:.2f} epochs to {args.tokens} tokens", file=sys.stderr, flush=True)

    torch.manual_seed(args.seed)
    head = new_head(target, [{"output_ids": ids[p:]} for ids, p in stream], args.draft_vocab_size,
                    args.width or None).train()
    t2d = target_to_draft(head, target.cfg.vocab_size)
    embed = torch.nn.Embedding.from_pretrained(target.embed_tokens.weight.float(), freeze=True)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    packs = sum(len(pack_batches([len(r[0]) for r in c], list(range(len(c))), args.pack_tokens)) for c in chunks)
    lr_at = lr_schedule(cfg, max(1, round(packs * args.tokens / available)))  # cosine over the whole run

    # the full state (optimizer included) sits beside the head, which git ignores in lanner/drafts/; the head and
    # training.json are what a commit carries from one machine to the next
    state_path, record_path = os.path.join(args.out, "train_state.pt"), os.path.join(args.out, "training.json")
    st = {"step": 0, "chunk": 0, "tokens": 0, "loss_tokens": 0, "train_cpu_s": 0.0, "feature_cpu_s": 0.0,
          "curve": []}
    if os.path.exists(state_path) and not args.no_resume:
        saved = torch.load(state_path, weights_only=False)
        head.load_state_dict(saved.pop("head"))
        opt.load_state_dict(saved.pop("opt"))
        st.update(saved)
        print(f"train-base: resumed at {st['tokens']} tokens (chunk {st['chunk']}, step {st['step']})",
              file=sys.stderr, flush=True)
    elif os.path.exists(record_path) and not args.no_resume:  # a committed head: its weights and counters
        with open(record_path) as f:
            record = json.load(f)
        saved = DraftHead.load(args.out)
        if not torch.equal(saved.d2t, head.d2t):
            sys.exit(f"train-base: the head in {args.out} has another draft vocabulary than these rows; "
                     "use --no-resume or another --out")
        head.load_state_dict(saved.state_dict())
        st.update(record["state"], curve=record["curve"])
        print(f"train-base: continuing the head in {args.out} at {st['tokens']} tokens (its optimizer state is "
              "not committed: AdamW restarts)", file=sys.stderr, flush=True)
    os.makedirs(args.out, exist_ok=True)
    points = [p for p in _points(args.first_point, args.tokens) if p > st["tokens"]]

    def save_state():
        head.save(args.out)
        write_record(args, st, stream, available, model_name)
        torch.save({**st, "head": head.state_dict(), "opt": opt.state_dict()}, state_path + ".tmp")
        os.replace(state_path + ".tmp", state_path)

    def evaluate():
        row = {"tokens": st["tokens"], "train_cpu_s": st["train_cpu_s"], "feature_cpu_s": st["feature_cpu_s"]}
        for name, seqs in held.items():
            s = score_sequences(head, target.embed_tokens.weight, target.cfg.vocab_size, seqs, args.eval_steps)
            row[name] = {k: s[k] for k in ("agreement", "replay_tau", "replay_accept_at", "coverage")}
        head.train()
        st["curve"].append(row)
        if len(st["curve"]) > 2:
            curve = st["curve"][1:]  # a log axis: the untrained origin has no place on it
            report.line_chart(os.path.join(args.out, "curve.png"), [r["tokens"] for r in curve],
                              {k: [r[k]["agreement"][0] for r in curve] for k in held},
                              "Base draft head (held-out, first token)", "training tokens seen",
                              "top-1 agreement, TTT step 0")
        tqdm.write(f"  {st['tokens']} tokens: " + ", ".join(
            f"{k} acc0 {row[k]['agreement'][0]:.3f} tau {row[k]['replay_tau']:.2f}" for k in held))
        save_state()

    if not st["curve"]:
        evaluate()  # the untrained head: the curve's origin
    bar = tqdm(total=args.tokens, initial=st["tokens"], desc="train-base", unit="tok", unit_scale=True)
    last_save = time.monotonic()
    stop = []  # SIGTERM: stop at the next chunk's end, checkpointed
    before = signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    while st["tokens"] < args.tokens and (not args.stop_at or st["tokens"] < args.stop_at) and not stop:
        i = st["chunk"] % len(chunks)
        c0 = time.process_time()
        items = feature_shard(ftarget, chunks[i], folder, i, layers, cfg.topk)
        st["feature_cpu_s"] += time.process_time() - c0
        order = torch.randperm(len(items), generator=torch.Generator().manual_seed(args.seed + st["chunk"])).tolist()
        for b in pack_batches([len(x[1]) for x in items], order, args.pack_tokens):
            c0 = time.process_time()
            n = _step(head, opt, embed, t2d, [items[k] for k in b], cfg, lr_at(st["step"]))
            st["train_cpu_s"] += time.process_time() - c0
            st["step"] += 1
            st["tokens"] += n
            st["loss_tokens"] += sum(len(items[k][1]) - items[k][4] for k in b)
            bar.update(n)
        st["chunk"] += 1
        spent = st["train_cpu_s"] + st["feature_cpu_s"]
        bar.set_postfix(tok_s=f"{st['tokens'] / max(spent, 1e-9):.0f}", epoch=f"{st['tokens'] / available:.2f}")
        if points and st["tokens"] >= points[0]:
            while points and st["tokens"] >= points[0]:
                points.pop(0)
            evaluate()
            last_save = time.monotonic()
        elif time.monotonic() - last_save > 60 * args.checkpoint_minutes:
            save_state()
            last_save = time.monotonic()
    bar.close()
    signal.signal(signal.SIGTERM, before)
    if st["tokens"] < args.tokens:  # --stop-at or SIGTERM: continued by the same command
        save_state()
        print(f"stopped at {st['tokens']} tokens; the same command continues", file=sys.stderr)
        return st
    if not st["curve"] or st["curve"][-1]["tokens"] != st["tokens"]:
        evaluate()
    print(f"wrote the head, training.json and curve.png to {args.out}")
    return st


def write_record(args, st: dict, stream, available: int, model: str):
    """training.json beside the head: the command's arguments, cost and the learning curve so far."""
    cpu = st["train_cpu_s"] + st["feature_cpu_s"]
    report.write_json(os.path.join(args.out, "training.json"), {
        "command": "train-base", "model": model,
        "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))},
        "rows": len(stream), "tokens_available": available,
        "state": {k: st[k] for k in ("step", "chunk", "tokens", "loss_tokens", "train_cpu_s", "feature_cpu_s")},
        "cost": {"tokens": st["tokens"], "loss_tokens": st["loss_tokens"], "optimizer_steps": st["step"],
                 "train_cpu_s": st["train_cpu_s"], "feature_cpu_s": st["feature_cpu_s"],
                 "tokens_per_cpu_s": st["tokens"] / max(cpu, 1e-9), "threads": torch.get_num_threads()},
        "curve": st["curve"]})
