"""Offline first-step agreement of draft heads on stored `lanner rcsd` features: per head, the step-0 top-1
agreement with the target and the mean -log alpha (alpha = sum_x min(p, q), speculative sampling's acceptance).

    python tools/head_agreement.py --prep DIR/prep-TAG-0028.pt --heads hass,default,OUT-lk
    python tools/head_agreement.py --prep ... --heads default --widen 8192 --data data/rcsd-more/lk.jsonl \
        --new-rows zero,target        # a head's vocabulary grown as `rcsd --draft-vocab-size` grows it, or not

The rows are training rows of the heads that trained on them: compare heads, not held-out acceptance."""
import argparse
import json

import torch

from lanner import LLM
from lanner.spec.draft_head import DraftHead
from lanner.spec.drafts import resolve_draft
from lanner.train.hass import target_to_draft, ttt_losses, widen_draft_vocabulary
from lanner.train.rcsd import Sequence


def agreement(head, model, embed, seqs) -> tuple[float, float]:
    t2d = target_to_draft(head, model.cfg.vocab_size)
    with torch.no_grad():
        out = [ttt_losses(head, embed, s.feats.float(), s.ids, s.top_i, s.top_p, t2d, s.prompt_len, 1, 1.0,
                          objective="lk", lk_kl_weight=0.0) for s in seqs]
    return sum(o[2][0] for o in out) / len(out), sum(o[1][0] for o in out) / len(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prep", required=True, help="a stored chunk of target features (rcsd --method lk)")
    ap.add_argument("--heads", required=True, help="comma-separated: 'hass', 'default' or folders")
    ap.add_argument("--limit", type=int, default=128, help="sequences of the chunk")
    ap.add_argument("--widen", type=int, default=0, help="grow each head's draft vocabulary to this size first")
    ap.add_argument("--data", help="with --widen: the rcsd sequences whose answers pick the added tokens")
    ap.add_argument("--new-rows", default="zero", help="with --widen: 'zero' (as rcsd does) and/or 'target' (rows "
                    "copied from the target's, as a new head starts)")
    args = ap.parse_args()
    model = LLM(kv_cache_memory="0.05GiB").engine.model
    embed = torch.nn.Embedding.from_pretrained(model.embed_tokens.weight.float())
    seqs = [Sequence.restore(g[0]) for g in torch.load(args.prep, weights_only=False)["groups"][: args.limit]]
    rows = [json.loads(line) for line in open(args.data)] if args.widen else []
    print("| head | vocabulary | step-0 top-1 agreement | mean -log alpha |\n|---|---|---|---|")
    for name in args.heads.split(","):
        variants = [("as trained", DraftHead.load(resolve_draft(name)))]
        for new_rows in args.new_rows.split(",") if args.widen else []:
            head = widen_draft_vocabulary(DraftHead.load(resolve_draft(name)), model, rows, args.widen)
            if new_rows == "target":
                lm = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
                n = len(variants[0][1].d2t)
                with torch.no_grad():
                    head.lm_head.weight[n:] = lm[head.d2t[n:]].float()
            variants.append((f"{args.widen}, new rows {new_rows}", head))
        for label, head in variants:
            top1, nla = agreement(head, model, embed, seqs)
            print(f"| {name} | {label if args.widen else len(head.d2t)} | {top1:.3f} | {nla:.3f} |")


if __name__ == "__main__":
    main()
