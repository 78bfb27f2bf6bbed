"""lanner train-curve: how fast does a draft head learn, per configuration, on this machine?

On one stored set of target features (ShareGPT prompts with ShareGPT's own replies; the loss is the target's
top-K distribution at every position either way), several head configurations (draft vocabulary x MLP width
x decoder layers) are trained for the same budget of tokens each. At geometric points of tokens seen each head is
scored on held-out sequences the target wrote itself (its greedy answers to held-out ShareGPT and MT-Bench prompts):
top-1 agreement at training-time-test step 0 (the first drafted token) and the offline replay tau of
lanner.train.eval_head.score_sequences (equal to live tau: docs/draft-heads.md). Cost per configuration: train
seconds, tokens/s, parameters, and the head's forward time per drafted token.

Depth is compared here before it is served: the serving path (DraftHeadProposer, its KV pool and the lowlat
plugin's fused draft step) runs one-layer heads, so a deeper head trains and scores offline only. Width
(DraftHeadConfig's intermediate_size) serves as it is.
"""
from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
import time

import torch
from tqdm import tqdm

from lanner.bench import report

HELP = "Learning curves of draft-head configurations on stored target features (agreement, tau, cost)."
DESCRIPTION = __doc__


def add_arguments(p):
    p.add_argument("--data", default="data/train-curve", help="cache folder: held-out answers, target features")
    p.add_argument("--num-sequences", type=int, default=1500, help="ShareGPT training prompts (with their replies)")
    p.add_argument("--max-len", type=int, default=512, help="tokens per training sequence")
    p.add_argument("--configs", default="4096x1536,8192x1536,16384x1536,8192x3072",
                   help="head configurations, VOCABxMLP_WIDTH[xLAYERS] (one decoder layer unless given), "
                        "comma-separated")
    p.add_argument("--tokens", type=int, default=200_000, help="training tokens (all positions) per configuration")
    p.add_argument("--points", type=int, default=5, help="evaluation points: tokens/2^(points-1) .. tokens")
    p.add_argument("--pack-tokens", type=int, default=2048, help="tokens per packed forward (0: one sequence)")
    add_training_arguments(p)
    p.add_argument("--feature-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="dtype the target runs in for the training features (bf16: 2.4x faster on this CPU)")
    p.add_argument("--measure-packing", type=int, default=24, metavar="N",
                   help="time N sequences trained one at a time and packed, before the curves (0: skip)")
    p.add_argument("--no-bf16", action="store_true",
                   help="train in float32 (default: bfloat16 autocast of the head's matmuls, float32 weights and loss)")
    p.add_argument("--reference", default="", metavar="HEADS",
                   help="also score these trained heads on the held-out sets ('hass', 'default' or folders, "
                        "comma-separated); --configs '' scores only them")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--prepare-only", action="store_true", help="compute and store the data and features, then stop")
    p.add_argument("--split-seed", type=int, default=0, help="seed of the ShareGPT 90/10 split")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="result file (default: OUT_DIR/train_curve.json)")
    p.add_argument("--out-dir", default="results")
    p.set_defaults(dtype="float32")  # the held-out answers: float32 greedy


def add_training_arguments(p):
    """The learning rate, chain lengths and held-out sets that train-curve and train-base share."""
    p.add_argument("--lr", type=float, default=5e-4, help="peak AdamW learning rate (warmup, cosine to --tokens)")
    p.add_argument("--ttt-steps", type=int, default=4, help="chained steps trained")
    p.add_argument("--eval-steps", type=int, default=4, help="chain length of the replay")
    p.add_argument("--heldout", default="sharegpt:20,mtbench:20", help="held-out sets, NAME:COUNT")
    p.add_argument("--max-new-tokens", type=int, default=96, help="length of the target's held-out answers")


def parse_configs(text: str) -> list[tuple[int, int, int]]:
    """"4096x1536,4096x1536x2" -> [(vocab, MLP width, decoder layers)]."""
    out = []
    for part in filter(None, (t.strip() for t in text.split(","))):
        try:
            v, w, *layers = (int(x) for x in part.lower().split("x"))
            if len(layers) > 1 or min([v, w] + layers) < 1:
                raise ValueError
            out.append((v, w, layers[0] if layers else 1))
        except ValueError:
            raise ValueError(f"--configs: {part!r} is not VOCABxWIDTH[xLAYERS] (e.g. 8192x1536 or 4096x1536x2)") \
                from None
    return out


def config_label(vocab: int, width: int, layers: int) -> str:
    return f"{vocab}x{width}" + (f"x{layers}" if layers > 1 else "")


def heldout_answers(llm, spec: str, max_new_tokens: int, data_dir: str) -> dict[str, list[tuple[list[int], int]]]:
    """{set: [(prompt + the target's greedy answer ids, prompt length)]}, cached in data_dir (keyed by the model,
    dtype, sets and length)."""
    from lanner.engine.sampling import SamplingParams
    from lanner.train.data import load_eval_set

    eng = llm.engine
    key = json.dumps([eng.source.name, str(eng.config.dtype), spec, max_new_tokens])
    path = os.path.join(data_dir, "heldout-" + hashlib.sha1(key.encode()).hexdigest()[:12] + ".json")
    if os.path.exists(path):
        with open(path) as f:
            return {k: [tuple(x) for x in v] for k, v in json.load(f).items()}
    out = {}
    for part in spec.split(","):
        name, count = part.split(":")
        items = load_eval_set(name, int(count))
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": it["turns"][0]}]) for it in items]
        res = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_new_tokens))
        out[name] = [(p + r.token_ids, len(p)) for p, r in zip(prompts, res)]
    os.makedirs(data_dir, exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f)
    return out


def head_ms_per_token(head, context: int = 256, reps: int = 100) -> float:
    """One drafted token as serving drafts it: one row through the head (fuse skipped: a chain step feeds its
    own hidden) attending to `context` cached keys in each layer, the draft-vocabulary logits included. float32,
    this thread count."""
    import torch.nn.functional as F

    h = head.cfg.hidden_size
    context = min(context, head.cfg.max_position_embeddings - 1)
    with torch.no_grad():
        kc = torch.randn(1, head.Hkv, context, head.D)
        vc = torch.randn(1, head.Hkv, context, head.D)
        x, e, pos = torch.randn(1, h), torch.randn(1, h), torch.tensor([context])
        rope = head.rotary.lookup(pos, x.dtype)  # one lookup per drafted token, shared by the layers

        def attend(q):
            a = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kc, vc, scale=head.scale, enable_gqa=True)
            return a[0].transpose(0, 1).reshape(1, -1)

        def one():
            out = head.first_layer_out(x, attend(head.qkv(x, e, pos)[0]))
            for layer in head.layers:
                out = layer.post(out, attend(layer.qkv(out, *rope)[0]))
            return head.logits(out)

        for _ in range(10):
            one()
        t = time.perf_counter()
        for _ in range(reps):
            one()
    return (time.perf_counter() - t) / reps * 1e3


def _step(head, opt, embed, t2d, items, cfg, lr):
    from lanner.train.hass import collate, ttt_losses

    f, ids, ti, tp, lens, plens = collate(items, "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
        loss, _, acc = ttt_losses(head, embed, f, ids, ti, tp, t2d, plens, cfg.ttt_steps, cfg.step_decay,
                                  lengths=lens)
    (loss / len(lens)).backward()
    for g in opt.param_groups:
        g["lr"] = lr
    torch.nn.utils.clip_grad_norm_([p for p in head.parameters() if p.requires_grad], cfg.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return sum(lens)


def measure_packing(target, sequences, cache, cfg, n: int, pack_tokens: int) -> dict:
    """Training tokens/s over the same n sequences, one per forward vs packed, in float32 and with bfloat16
    autocast (a fresh 4k head each time)."""
    from dataclasses import replace

    from lanner.train.hass import new_head, pack_batches, target_to_draft

    embed = torch.nn.Embedding.from_pretrained(target.embed_tokens.weight.float(), freeze=True)
    items = cache[:n]
    out = {}
    for name, pt, bf16 in (("one_sequence", 0, False), ("packed", pack_tokens, False),
                           ("one_sequence_bf16", 0, True), ("packed_bf16", pack_tokens, True)):
        c = replace(cfg, bf16=bf16)
        torch.manual_seed(0)
        head = new_head(target, sequences, 4096).train()
        opt = torch.optim.AdamW(head.parameters(), lr=1e-4, betas=(0.9, 0.95))
        t2d = target_to_draft(head, target.cfg.vocab_size)
        batches = pack_batches([len(c[1]) for c in items], list(range(len(items))), pt)
        _step(head, opt, embed, t2d, [items[i] for i in batches[0]], c, 1e-4)  # warm up (allocator, masks)
        t, tokens = time.perf_counter(), 0
        for b in batches:
            tokens += _step(head, opt, embed, t2d, [items[i] for i in b], c, 1e-4)
        out[name] = {"tokens": tokens, "seconds": time.perf_counter() - t, "batches": len(batches)}
        out[name]["tokens_per_s"] = tokens / out[name]["seconds"]
    out["pack_tokens"] = pack_tokens
    return out


def train_config(target, sequences, cache, heldout, vocab: int, width: int, layers: int, args, cfg) -> dict:
    """One configuration: train for args.tokens, scoring the held-out sets at the curve's points."""
    from lanner.train.eval_head import score_sequences
    from lanner.train.hass import lr_schedule, new_head, pack_batches, target_to_draft

    torch.manual_seed(args.seed)
    head = new_head(target, sequences, vocab, width, layers).train()
    t2d = target_to_draft(head, target.cfg.vocab_size)
    embed = torch.nn.Embedding.from_pretrained(target.embed_tokens.weight.float(), freeze=True)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    lengths = [len(c[1]) for c in cache]
    per_pack = max(1.0, sum(lengths) / len(pack_batches(lengths, list(range(len(cache))), args.pack_tokens)))
    lr_at = lr_schedule(cfg, max(1, round(args.tokens / per_pack)))  # cosine over the whole budget
    points = [round(args.tokens / 2 ** k) for k in range(args.points - 1, -1, -1)]

    def evaluate(point, tokens, train_s):
        row = {"point": point, "tokens": tokens, "train_s": train_s}
        for name, seqs in heldout.items():
            s = score_sequences(head, target.embed_tokens.weight, target.cfg.vocab_size, seqs, args.eval_steps)
            row[name] = {"agreement": s["agreement"], "replay_tau": s["replay_tau"],
                         "replay_accept_at": s["replay_accept_at"], "coverage": s["coverage"]}
        head.train()
        return row

    curve = [evaluate(0, 0, 0.0)]
    tokens, loss_tokens, train_s, step, epoch = 0, 0, 0.0, 0, 0
    bar = tqdm(total=args.tokens, desc=f"vocab {vocab} width {width} layers {layers}", unit="tok", unit_scale=True)
    while tokens < args.tokens:
        order = torch.randperm(len(cache), generator=torch.Generator().manual_seed(args.seed + epoch)).tolist()
        for b in pack_batches(lengths, order, args.pack_tokens):
            t = time.perf_counter()
            n = _step(head, opt, embed, t2d, [cache[i] for i in b], cfg, lr_at(step))
            train_s += time.perf_counter() - t  # the clock stops while scoring
            step += 1
            tokens += n
            loss_tokens += sum(len(cache[i][1]) - cache[i][4] for i in b)
            bar.update(n)
            bar.set_postfix(tok_s=f"{tokens / train_s:.0f}")
            while points and tokens >= points[0]:
                curve.append(evaluate(points.pop(0), tokens, train_s))
                bar.write(f"  {tokens} tokens: " + ", ".join(
                    f"{k} acc0 {curve[-1][k]['agreement'][0]:.3f} tau {curve[-1][k]['replay_tau']:.2f}"
                    for k in heldout))
            if tokens >= args.tokens:
                break
        epoch += 1
    bar.close()
    head.eval()
    return {"vocab": vocab, "width": width, "layers": layers, "params": sum(p.numel() for p in params), "train_s": train_s,
            "tokens": tokens, "loss_tokens": loss_tokens, "optimizer_steps": step, "epochs_seen": tokens / sum(lengths),
            "tokens_per_s": tokens / train_s, "head_ms_per_token": head_ms_per_token(head), "curve": curve}


def _training_cost(path: str) -> dict | None:
    """The cost record a head's training left beside it (training.json), if any."""
    f = os.path.join(path, "training.json")
    if not os.path.exists(f):
        return None
    with open(f) as fh:
        return json.load(fh).get("cost")


def run(args, engine_options: dict) -> dict:
    from lanner.llm import LLM
    from lanner.models.loader import load_config, load_model
    from lanner.spec.draft_head import DraftHeadConfig
    from lanner.train.data import original_responses, split_sharegpt
    from lanner.train.hass import TrainConfig, cached_features, feature_cache_dir, training_rows

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        configs = parse_configs(args.configs)
    except ValueError as e:
        sys.exit(f"lanner: error: {e}")
    cfg = TrainConfig(ttt_steps=args.ttt_steps, lr=args.lr, max_len=args.max_len, grad_accum=1,
                      warmup_steps=20, seed=args.seed, bf16=not args.no_bf16)
    json_path, png_path = report.output_paths(args.json, args.out_dir, "train_curve")
    llm = LLM(**{**engine_options, "spec": None, "draft": None})
    eng = llm.engine
    t0 = time.perf_counter()
    heldout = heldout_answers(llm, args.heldout, args.max_new_tokens, args.data)
    heldout_s = time.perf_counter() - t0
    target = eng.model  # float32: the held-out features, the head's embedding and its initial rows
    layers = DraftHeadConfig.for_target(target.cfg).feature_layers
    held_rows = {k: [(ids, plen) for ids, plen in v] for k, v in heldout.items()}
    held = {}
    for name, rows in held_rows.items():
        folder = feature_cache_dir(args.data, eng.source.name, layers, 1, 10**9, "heldout-" + name +
                                   str(eng.config.dtype) + str(len(rows)) + str(args.max_new_tokens))
        held[name] = [(f, i.tolist(), p) for f, i, _, _, p in
                      cached_features(target, rows, folder, layers, 1, desc=f"held-out {name} features")]
    tok = llm.tokenizer
    train, _ = split_sharegpt(args.split_seed)
    sequences = original_responses(tok, train[: args.num_sequences], tok.eos_token_ids[0] if tok.eos_token_ids else None)
    rows = training_rows(sequences, args.max_len)
    fdtype = getattr(torch, args.feature_dtype)
    folder = feature_cache_dir(args.data, eng.source.name, layers, cfg.topk, args.max_len, fdtype)
    t0 = time.perf_counter()
    ftarget = target if fdtype == torch.float32 else load_model(eng.source, fdtype, "cpu", load_config(eng.source))[0]
    cache = cached_features(ftarget, rows, folder, layers, cfg.topk)
    feature_s = time.perf_counter() - t0
    del ftarget
    gc.collect()
    print(f"train-curve: {len(cache)} training sequences ({sum(len(c[1]) for c in cache)} tokens) in {folder}; "
          f"held-out {', '.join(f'{k} x{len(v)}' for k, v in held.items())}", file=sys.stderr, flush=True)
    if args.prepare_only:
        return {}

    reference = {}
    for name in filter(None, (t.strip() for t in args.reference.split(","))):
        from lanner.spec.draft_head import DraftHead
        from lanner.spec.drafts import resolve_draft
        from lanner.train.eval_head import score_sequences

        path = resolve_draft(name)
        head = DraftHead.load(path)
        reference[name] = {"path": path, "vocab": head.cfg.draft_vocab_size, "width": head.cfg.intermediate_size,
                           "params": sum(p.numel() for p in head.parameters()),
                           "training": _training_cost(path),
                           **{k: score_sequences(head, target.embed_tokens.weight, target.cfg.vocab_size, v,
                                                 args.eval_steps) for k, v in held.items()}}
    packing = measure_packing(target, sequences, cache, cfg, args.measure_packing, args.pack_tokens) \
        if args.measure_packing and configs else None
    if packing:
        print("training tokens/s: " + ", ".join(f"{k} {v['tokens_per_s']:.0f}" for k, v in packing.items()
                                                if isinstance(v, dict)) + f" (packs of {args.pack_tokens} tokens)",
              file=sys.stderr)
    results = []
    for vocab, width, layers in configs:
        results.append(train_config(target, sequences, cache, held, vocab, width, layers, args, cfg))
    result = {"eval": "train_curve", "model": eng.source.name, "args": {k: v for k, v in vars(args).items()
                                                                        if isinstance(v, (int, float, str, bool))},
              "threads": torch.get_num_threads(), "train_sequences": len(cache),
              "train_tokens_available": sum(len(c[1]) for c in cache), "feature_dtype": args.feature_dtype,
              "bf16_autocast": cfg.bf16, "feature_s": feature_s, "heldout_s": heldout_s, "heldout": {k: len(v) for k, v in held.items()},
              "packing": packing, "configs": results, "reference": reference}
    report.write_json(json_path, result)
    names = list(held)
    if reference:
        print(report.markdown_table(["reference head", "vocab x width"] + [f"{n} acc0" for n in names] +
                                    [f"{n} tau" for n in names],
                                    [[k, f"{r['vocab']}x{r['width']}"] + [report.fmt(r[n]["agreement"][0], 3)
                                                                          for n in names] +
                                     [report.fmt(r[n]["replay_tau"], 2) for n in names]
                                     for k, r in reference.items()]))
    if not results:
        print(f"\nwrote {json_path}")
        return result
    x = [c["point"] for c in results[0]["curve"][1:]]  # nominal points (each run passes them by < one pack)
    series = {}
    for r in results:
        for name in names:
            label = config_label(r["vocab"], r["width"], r.get("layers", 1))
            series[f"{label} {name}"] = [c[name]["agreement"][0] for c in r["curve"][1:]]
    report.line_chart(png_path, x, series, "Draft head learning curve (held-out, first token)",
                      "training tokens seen", "top-1 agreement, TTT step 0")
    headers = ["vocab x width [x layers]", "params (M)", "tokens/s", "train s", "head ms/token", "tokens seen"]
    for name in names:
        headers += [f"{name} acc0", f"{name} tau"]
    table = []
    for r in results:
        for c in r["curve"]:
            row = [config_label(r["vocab"], r["width"], r.get("layers", 1)), f"{r['params'] / 1e6:.1f}",
                   f"{r['tokens_per_s']:.0f}",
                   f"{r['train_s']:.0f}", f"{r['head_ms_per_token']:.2f}", c["tokens"]]
            for name in names:
                row += [report.fmt(c[name]["agreement"][0], 3), report.fmt(c[name]["replay_tau"], 2)]
            table.append(row)
    print(report.markdown_table(headers, table))
    print(f"\nwrote {json_path} and {png_path}")
    return result
