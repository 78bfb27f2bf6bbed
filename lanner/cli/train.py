"""lanner eval-accept, eval-head, train-curve, train-base, train-draft and rcsd: measuring and training draft heads."""
from __future__ import annotations

import dataclasses
import importlib.util
import sys

from lanner.cli.options import (
    HelpFormatter,
    add_config_args,
    engine_kwargs,
    new_parser,
    single_process,
)

# ------------------------------------------------------------------ eval-accept, eval-head

def _eval_command(sub, name: str, module: str):
    """A command of lanner.train.<module>: HELP, DESCRIPTION, add_arguments(p), run(args, engine_options). It holds
    two engines at once, so it runs in one process. conflict_handler="resolve": the command's own --draft (which
    takes 'default'/'hass'/...) replaces the engine option of that name."""
    mod = importlib.import_module(f"lanner.train.{module}")
    p = sub.add_parser(name, help=mod.HELP, description=mod.DESCRIPTION, formatter_class=HelpFormatter,
                       conflict_handler="resolve")
    add_config_args(p)
    mod.add_arguments(p)

    def run(args):  # the result dict is written to a file; the command's exit status is 0
        mod.run(args, single_process(engine_kwargs(args, exclude=("draft",)), name))  # its --draft is its own

    p.set_defaults(run=run)


def add_eval_accept(sub):
    _eval_command(sub, "eval-accept", "eval_accept")


def add_eval_head(sub):
    _eval_command(sub, "eval-head", "eval_head")


def add_train_curve(sub):
    _eval_command(sub, "train-curve", "curve")


def add_train_base(sub):
    _eval_command(sub, "train-base", "base")


# ------------------------------------------------------------------ train-draft

def add_train_draft(sub):
    from lanner.train.hass import TrainConfig

    p = new_parser(sub, "train-draft", "Train an EAGLE-3-style draft head (HASS-style distillation).",
                   "Regenerates ShareGPT (90% split) responses with the target through Lanner's engine (cached in "
                   "--data, resumable), then trains a draft head with training-time test over --ttt-steps chained "
                   "steps, top-K distillation and harmonized context alignment. Writes the head (config.json + "
                   "model.safetensors), training.json (cost, loss history) and loss.png to --out.")
    add_config_args(p)
    p.add_argument("--out", required=True, help="output folder for the head")
    p.add_argument("--data", default="data/train-draft", help="folder of the regenerated training data")
    p.add_argument("--num-prompts", type=int, default=400, help="ShareGPT training prompts to use")
    p.add_argument("--max-new-tokens", type=int, default=192, help="response length cap when regenerating")
    p.add_argument("--gen-temperature", type=float, default=0.0, help="0: greedy regeneration")
    p.add_argument("--original-responses", type=int, default=0, metavar="N",
                   help="also train on the next N ShareGPT training prompts with ShareGPT's own replies (cheap: "
                        "no regeneration; the loss is still on the target's distribution)")
    p.add_argument("--split-seed", type=int, default=0, help="seed of the ShareGPT 90/10 split")
    p.add_argument("--no-resume", action="store_true", help="start training from scratch")
    p.add_argument("--threads", type=int, default=0, help="torch threads for features and training (0: torch's default)")
    p.add_argument("--features", default=None, metavar="DIR",
                   help="folder of the stored target features (default: --data/features-<hash of model, layers, "
                        "top-K, max-len, dtype>; shards already there are reused)")
    p.add_argument("--bf16", action="store_true",
                   help="bfloat16 autocast of the head's matmuls (float32 weights, optimizer and loss): 2.3x tokens/s "
                        "on a CPU with AVX512-BF16")
    p.add_argument("--init", default=None, metavar="HEAD",
                   help="continue training this head ('hass', 'default' or a folder; its draft vocabulary is kept) "
                        "instead of starting a new one")
    defaults = TrainConfig()
    for name, help_text in [("ttt_steps", "chained steps trained (training-time test)"),
                            ("topk", "target top-K probabilities distilled"),
                            ("draft_vocab_size", "reduced draft vocabulary (most frequent target tokens)"),
                            ("max_len", "tokens per training sequence"), ("epochs", "passes over the data"),
                            ("lr", "peak AdamW learning rate"), ("warmup_steps", "linear warmup steps"),
                            ("grad_accum", "sequences per optimizer step"), ("grad_clip", "gradient norm clip"),
                            ("checkpoint_every", "optimizer steps between resumable checkpoints"),
                            ("pack_tokens", "pack sequences into forwards of up to this many tokens (0: one "
                                            "sequence per forward; --grad-accum then counts packs)"),
                            ("seed", "training seed")]:
        value = getattr(defaults, name)
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=value, help=help_text)
    p.set_defaults(run=run_train_draft)


def run_train_draft(args):
    import torch

    from lanner.llm import LLM
    from lanner.spec.draft_head import DraftHeadConfig
    from lanner.spec.drafts import resolve_draft
    from lanner.train.data import (
        generate_responses,
        load_training_data,
        original_responses,
        split_sharegpt,
    )
    from lanner.train.hass import TrainConfig, feature_cache_dir, train_draft_head

    if args.threads:
        torch.set_num_threads(args.threads)
    # the data is the target's own decoding: no draft head (speculation would be lossless, but costs a load)
    kwargs = engine_kwargs(args) | ({"spec": None} if args.spec == "auto" else {})
    llm = LLM(**single_process(kwargs, "train-draft"))
    train, _ = split_sharegpt(args.split_seed)
    path = generate_responses(llm, train[: args.num_prompts], args.data, max_new_tokens=args.max_new_tokens,
                              temperature=args.gen_temperature, split_seed=args.split_seed, train_frac=0.9)
    sequences = load_training_data(path)
    if args.original_responses:
        tok = llm.engine.tokenizer
        extra = train[args.num_prompts : args.num_prompts + args.original_responses]
        sequences += original_responses(tok, extra, tok.eos_token_ids[0] if tok.eos_token_ids else None)
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in vars(args).items() if k in fields})
    init = resolve_draft(args.init) if args.init else None
    model = llm.engine.model
    features = args.features or feature_cache_dir(args.data, llm.engine.source.name,
                                                  DraftHeadConfig.for_target(model.cfg).feature_layers, cfg.topk,
                                                  cfg.max_len, model.embed_tokens.weight.dtype)
    train_draft_head(model, sequences, args.out, cfg, resume=not args.no_resume, init=init, feature_dir=features)
    plot = " and loss.png" if importlib.util.find_spec("matplotlib") else ""  # the plot needs lanner[bench]
    print(f"wrote the draft head to {args.out} (training.json{plot} beside it)")


# ------------------------------------------------------------------ rcsd

def add_rcsd(sub):
    from lanner.train.rcsd import RCSDConfig

    p = new_parser(sub, "rcsd", "Continue training a draft head with DPO or GRPO for acceptance length (RCSD), or "
                   "with a direct acceptance objective (LK) as a control.",
                   "Generates, through Lanner's engine with the --init head as draft, per ShareGPT training prompt "
                   "a target-only sequence and sequences where the draft writes k tokens after each target token "
                   "without verification (cached in --data, resumable); then continues training the head with DPO "
                   "or GRPO against the frozen --init head as reference (LK: the target-only sequences alone). "
                   "Writes the head, training.json (cost, history) and curves.png to --out.")
    add_config_args(p)
    p.add_argument("--method", choices=["dpo", "grpo", "lk"], required=True)
    p.add_argument("--init", default="hass", help="the HASS head to start from: 'hass', 'default' or a folder")
    p.add_argument("--out", required=True, help="output folder for the trained head")
    p.add_argument("--data", default="data/rcsd/sequences.jsonl", help="cache of the generated sequences")
    p.add_argument("--features", default=None, help="folder of the stored target features and reference scores "
                   "(default --out): runs with other training settings on the same sequences read them back")
    p.add_argument("--num-prompts", type=int, default=200, help="ShareGPT training prompts (90%% split)")
    p.add_argument("--skip-prompts", type=int, default=0, help="training prompts to pass over first (continuing "
                   "a head that has trained on them)")
    p.add_argument("--code-prompts", type=int, default=0, metavar="N", help="also N HumanEval-style tasks from "
                   "real source files (signature and docstring of installed packages' functions; no HumanEval task)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per generated sequence")
    p.add_argument("--gen-batch", type=int, default=8, help="sequences generated per engine batch (lowlat runs "
                   "steps of up to its max_batch, 8, on its kernels; larger ones on the engine's slower forward)")
    p.add_argument("--split-seed", type=int, default=0, help="seed of the ShareGPT 90/10 split")
    p.add_argument("--no-resume", action="store_true", help="start training from scratch")
    p.add_argument("--ks", default="1,2,3", help="GRPO: draft lengths of the draft-alternating group members")
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast of the head's matmuls in training")
    p.add_argument("--accept", choices=["sampled", "greedy"], default="sampled", help="LK: the acceptance it "
                   "raises, speculative sampling's or greedy verification's (the draft's probability of the "
                   "target's top-1)")
    p.add_argument("--draft-vocab-size", type=int, default=0, help="grow the head's draft vocabulary to this many "
                   "tokens (the target's most frequent answer tokens it lacks, zero output rows, learned in training)")
    defaults = RCSDConfig()
    for name, help_text in [("k", "DPO: draft tokens per target token in the bad sequence (serving depth)"),
                            ("beta", "DPO temperature / GRPO KL weight"), ("epsilon", "GRPO ratio clip"),
                            ("epochs", "passes over the prompts"), ("lr", "peak AdamW learning rate"),
                            ("warmup_steps", "linear warmup steps"), ("grad_accum", "prompts per optimizer step"),
                            ("max_len", "tokens per sequence"), ("seed", "training seed"),
                            ("checkpoint_every", "optimizer steps between resumable checkpoints")]:
        value = getattr(defaults, name)
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=value, help=help_text)
    p.set_defaults(run=run_rcsd)


def run_rcsd(args):
    from lanner.llm import LLM
    from lanner.spec.drafts import resolve_draft
    from lanner.train.data import code_prompts, split_sharegpt
    from lanner.train.rcsd import RCSDConfig, generate_sequences, train_rcsd

    try:
        cfg = RCSDConfig(method=args.method, k=args.k, ks=tuple(int(x) for x in args.ks.split(",")),
                         beta=args.beta, epsilon=args.epsilon, epochs=args.epochs, lr=args.lr,
                         warmup_steps=args.warmup_steps, grad_accum=args.grad_accum, max_len=args.max_len,
                         checkpoint_every=args.checkpoint_every, seed=args.seed, bf16=args.bf16,
                         accept=args.accept, draft_vocab_size=args.draft_vocab_size)
        init = resolve_draft(args.init)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"lanner: error: {e}")
    kwargs = single_process(engine_kwargs(args), "rcsd") | {
        "spec": "draft", "draft": init, "spec_tokens": cfg.max_chain, "spec_max_batch": args.gen_batch,
        "max_num_seqs": args.gen_batch}
    if not cfg.draft_lengths:  # target-only sequences alone (LK): plain batched decoding writes them fastest
        kwargs |= {"spec": "none", "draft": None}
    llm = LLM(**kwargs)
    train, _ = split_sharegpt(args.split_seed)
    prompts = train[args.skip_prompts : args.skip_prompts + args.num_prompts] + code_prompts(args.code_prompts)
    rows = generate_sequences(llm, prompts, args.data, cfg.draft_lengths, args.max_new_tokens,
                              args.gen_batch)
    train_rcsd(llm.engine.model, init, rows, args.out, cfg, resume=not args.no_resume, prep_dir=args.features)
    print(f"wrote the {args.method} head to {args.out} (training.json, curves.png beside it)")
