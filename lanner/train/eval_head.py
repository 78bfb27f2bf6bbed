"""Diagnosis of a draft head: does what training measures match what serving gets?

On held-out prompts the target answers greedily (plain engine); on those exact sequences the head is scored
four ways, in one run:
  (a) teacher-forced top-1 agreement per chain step j, offline: the training-time-test forward (lanner.train.hass)
      over the target's features, step j fed the head's own outputs of steps < j, exactly as training scores it;
  (b) live acceptance per chain position through the engine's speculative path (the same prompts, greedy),
      next to the same walk replayed offline on (a)'s predictions: live decoding drafts only after an accepted
      run and the target's token, so it visits other positions than (a) averages over; the replay visits the
      same ones, and equals (b) when serving feeds the head what training did;
  (c) coverage: the share of the target's greedy tokens the draft vocabulary holds (a ceiling on (a) and (b));
  (d) the replay again with the target's features computed in bfloat16 instead of float32.
If the replay and (b) part, training and serving feed the head differently; if (a) is far below (c), the head
underfits; if (d) is far below the float32 replay, the head is sensitive to the features' precision.
"""
from __future__ import annotations

import gc
import sys

import torch

from lanner.bench import report
from lanner.train.data import EVAL_SETS, load_eval_set

HELP = "Diagnose a draft head: offline agreement vs live acceptance, vocabulary coverage, feature precision."
DESCRIPTION = __doc__


def add_arguments(p):
    import argparse

    p.add_argument("--draft", default="default", help="draft head: 'default', 'hass' or a folder")
    p.add_argument("--datasets", default="sharegpt,mtbench", help=f"comma-separated, from {','.join(EVAL_SETS)}")
    p.add_argument("--limit", type=int, default=20, help="prompts per dataset (the first N; first turns only)")
    p.add_argument("--steps", type=int, default=4, help="chain positions to score (1..8)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="most tokens the target generates per prompt")
    p.add_argument("--json", default=None, help="result file (default: OUT_DIR/eval_head.json)")
    p.add_argument("--out-dir", default="results")
    for flag, default, type_ in (("--spec", None, str), ("--spec-tokens", None, int), ("--spec-max-batch", 1, int)):
        p.add_argument(flag, default=default, type=type_, help=argparse.SUPPRESS)
    p.set_defaults(dtype="float32")  # the target's greedy answers and (a) in float32: (b) then sees the same text


@torch.no_grad()
def offline_agreement(target, head, sequences: list[tuple[list[int], int]], steps: int) -> dict:
    """Teacher-forced scores of a head on (prompt + greedy answer ids, prompt length) sequences, the target's
    features computed here (see `score_sequences`)."""
    from lanner.train.hass import target_features

    return score_sequences(head, target.embed_tokens.weight, target.cfg.vocab_size,
                           [(target_features(target, ids, head.cfg.feature_layers, topk=1)[0], ids, plen)
                            for ids, plen in sequences], steps)


@torch.no_grad()
def score_sequences(head, embed_weight, vocab_size: int, sequences: list[tuple[torch.Tensor, list[int], int]],
                    steps: int) -> dict:
    """Scores of a head on (target features [>= T-1, 3h], ids [T], prompt length) sequences:
    agreement: (a) per chain step j, the share of answer positions where the head's top-1 (chained hidden states,
        as training-time test scores it) is the target's greedy token;
    coverage: (c) the share of answer tokens in the draft vocabulary;
    replay: the engine's greedy walk replayed on these predictions (a chain of `steps` drafts after each emitted
        token, the next chain after the accepted ones and the target's own token): acceptance per chain position
        and tau. It visits the positions live decoding visits, so it should equal (b) when serving feeds the head
        what training did."""
    from lanner.train.hass import ttt_forward

    was_training = head.training
    head = head.float().eval()
    embed = torch.nn.Embedding.from_pretrained(embed_weight.float(), freeze=True)
    vocab = torch.zeros(vocab_size, dtype=torch.bool)
    vocab[head.d2t] = True
    agree, count, covered, answered = [0] * steps, [0] * steps, 0, 0
    accepted_at, chains, emitted = [0] * steps, 0, 0
    for feats, ids, plen in sequences:
        t = torch.tensor(ids)
        n = len(ids) - 2  # positions p = 0..n-1 predict ids[p + 2]
        pos = torch.arange(n)
        preds = []
        for j, logits in enumerate(ttt_forward(head, embed, feats.float(), t, steps)):
            pred = head.d2t[logits[:n].argmax(-1)]
            ok = (pos >= j) & (pos + 2 >= plen)  # a chain step j needs a target feature at p - j
            agree[j] += int(((pred == t[2:]) & ok).sum())
            count[j] += int(ok.sum())
            preds.append(pred.tolist())
        covered += int(vocab[t[plen:]].sum())
        answered += len(ids) - plen
        p = plen - 1  # after the prefill's token ids[plen], the first chain: features at plen - 1
        while p + 2 < len(ids):
            a = 0
            while a < steps and p + a < n and preds[a][p + a] == ids[p + 2 + a]:
                accepted_at[a] += 1
                a += 1
            chains += 1
            emitted += a + 1
            p += a + 1
    head.train(was_training)
    return {"agreement": [a / c if c else None for a, c in zip(agree, count)],
            "coverage": covered / max(1, answered),
            "replay_accept_at": [a / chains if chains else None for a in accepted_at],
            "replay_tau": emitted / chains if chains else None}


def run(args, engine_options: dict) -> dict:
    from lanner.llm import LLM
    from lanner.models.loader import load_config, load_model
    from lanner.spec.draft_head import DraftHead
    from lanner.spec.drafts import resolve_draft
    from lanner.train.eval_accept import evaluate

    if not 1 <= args.steps <= 8:
        sys.exit(f"lanner: error: --steps must be in 1..8, got {args.steps}")
    names = [d.strip() for d in args.datasets.split(",") if d.strip()]
    bad = [d for d in names if d not in EVAL_SETS]
    if bad or not names:
        sys.exit(f"lanner: error: --datasets: unknown {', '.join(bad) or '(none)'}; choose from {', '.join(EVAL_SETS)}")
    try:
        path = resolve_draft(args.draft)
        datasets = {d: [{**it, "turns": it["turns"][:1]} for it in load_eval_set(d, args.limit)] for d in names}
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"lanner: error: {e}")
    json_path, png_path = report.output_paths(args.json, args.out_dir, "eval_head")

    llm_plain = LLM(**{**engine_options, "spec": None, "draft": None})
    llm_spec = LLM(**{**engine_options, "spec": "draft", "draft": path, "spec_max_batch": 1,
                      "spec_tokens": args.steps})
    engine, tok = llm_plain.engine, llm_plain.tokenizer
    print(f"eval-head: {engine.source.name} ({engine.config.dtype}), head {path}, "
          f"{', '.join(f'{n} x{len(v)}' for n, v in datasets.items())}", file=sys.stderr, flush=True)
    plain_cache: dict = {}
    live = evaluate(llm_spec, llm_plain, datasets, [args.steps], args.max_new_tokens, draft=args.draft,
                    plain_cache=plain_cache)
    sequences = {}
    for name, items in datasets.items():
        sequences[name] = []
        for item, outs in zip(items, plain_cache[name]["token_ids"]):
            prompt = tok.apply_chat_template([{"role": "user", "content": item["turns"][0]}])
            sequences[name].append((prompt + outs[0], len(prompt)))
    source, loaded = engine.source, load_config(engine.source)
    del llm_plain, llm_spec
    gc.collect()

    head = DraftHead.load(path)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        target, _ = load_model(source, dtype, "cpu", loaded)
        for name in datasets:
            rows.append({"dataset": name, "features": str(dtype).replace("torch.", ""),
                         **offline_agreement(target, head, sequences[name], args.steps)})
        del target
        gc.collect()
    table_rows, series = [], {}
    for name in datasets:
        f32, bf = (next(r for r in rows if r["dataset"] == name and r["features"] == f)
                   for f in ("float32", "bfloat16"))
        lv = next(r for r in live if r["dataset"] == name)
        live_at = lv["accept_rate_at"] + [0.0] * (args.steps - len(lv["accept_rate_at"]))
        for j in range(args.steps):
            table_rows.append([name, j + 1, report.fmt(f32["agreement"][j], 3), report.fmt(f32["replay_accept_at"][j], 3),
                               report.fmt(live_at[j], 3), report.fmt(bf["replay_accept_at"][j], 3),
                               report.fmt(f32["coverage"], 3), report.fmt(f32["replay_tau"], 2),
                               report.fmt(lv["tau"], 2)])
        series[f"{name}: offline replay"] = [a or 0.0 for a in f32["replay_accept_at"]]
        series[f"{name}: live"] = live_at
    result = {"eval": "head", "model": source.name, "draft": args.draft, "draft_path": path,
              "datasets": names, "limit": args.limit, "steps": args.steps, "max_new_tokens": args.max_new_tokens,
              "offline": rows, "live": live}
    report.write_json(json_path, result)
    report.line_chart(png_path, list(range(1, args.steps + 1)), series, f"Head {args.draft}: offline replay vs live",
                      "chain position", "P(accepted)")
    print(report.markdown_table(
        ["dataset", "position", "(a) agreement", "offline replay P(acc)", "(b) live P(acc)",
         "(d) replay, bf16 features", "(c) vocab coverage", "replay tau", "live tau"], table_rows))
    print("\n(a): teacher-forced top-1 agreement over every answer position; replay: the engine's greedy walk on the "
          "offline predictions (the positions live decoding visits); (b) from the engine itself")
    print(f"\nwrote {json_path} and {png_path}")
    return result
