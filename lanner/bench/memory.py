"""Memory per tensor-parallel rank: KV-cache bytes per token and weight bytes, for each --tp size.

Each rank's shard is built on the meta device under that rank's layout (no weights read, no processes), and its
KV bytes per token come from ModelRunner.bytes_per_token(model, dtype), the number the engine sizes its pool by.
A model with `kv_replicated_across_tp = True` (MLA: the latent cache is whole on every rank) holds the same KV
on every rank, so (tp-1)/tp of the total is duplicated; otherwise the KV heads are split and nothing is.
"""
from __future__ import annotations

import sys

from lanner.bench import report

HELP = "KV-cache and weight bytes per tensor-parallel rank."
DESCRIPTION = (
    "For each --tp size (e.g. --tp 1,2): KV-cache bytes per token on each rank, their total across ranks, how much "
    "of it is unique vs duplicated (MLA models keep the whole latent cache on every rank), and weight bytes per "
    "rank. Builds each rank's shard on the meta device: nothing is loaded and no process is started.")


def add_arguments(p):
    p.add_argument("--json", default=None, help="result file (default: OUT_DIR/bench_memory.json)")
    p.add_argument("--out-dir", default="results", help="folder for the result file when --json is not given")


def rank_shards(cfg, freq_factors, size: int):
    """Yields each rank's model of a size-way split, built on the meta device."""
    import torch

    from lanner.distributed import tp_layout
    from lanner.models.loader import model_class

    for rank in range(size):
        with tp_layout(rank, size), torch.device("meta"):
            yield model_class(cfg)(cfg, freq_factors)


def measure(cfg, freq_factors, size: int, dtype) -> dict:
    import torch

    from lanner.engine.runner import ModelRunner

    kv, weights, replicated = [], [], False
    for model in rank_shards(cfg, freq_factors, size):
        kv.append(ModelRunner.bytes_per_token(model, dtype))
        # floating weights are held in the engine dtype (GGUF ones are dequantized to it)
        weights.append(sum(p.numel() * (torch.finfo(dtype).bits // 8 if p.is_floating_point() else p.element_size())
                           for p in model.parameters()))
        replicated = bool(getattr(model, "kv_replicated_across_tp", False))
    total = sum(kv)
    duplicated = total * (size - 1) // size if replicated else 0
    return {"tp": size, "kv_bytes_per_token_per_rank": kv, "kv_bytes_per_token_total": total,
            "kv_bytes_per_token_unique": total - duplicated, "kv_bytes_per_token_duplicated": duplicated,
            "kv_replicated_across_tp": replicated, "weight_bytes_per_rank": weights,
            "weight_bytes_total": sum(weights)}


def run(args, engine_options: dict) -> dict:
    from lanner.config import DTYPES
    from lanner.models.loader import ModelSource, load_config

    sizes = args.tp or [1]
    json_path, _ = report.output_paths(args.json, args.out_dir, "bench_memory")
    source = ModelSource.resolve(engine_options["model"])
    cfg, freq_factors, _ = load_config(source)
    dtype = engine_options["dtype"]
    rows = []
    for size in sizes:
        try:
            rows.append(measure(cfg, freq_factors, size, DTYPES[dtype]))
        except ValueError as e:  # e.g. more ranks than KV heads
            sys.exit(f"lanner: error: --tp {size}: {e}")
    result = {"benchmark": "memory", "model": source.name, "model_path": source.path,
              "architecture": cfg.architecture, "dtype": dtype, "sizes": rows}
    report.write_json(json_path, result)
    print(format_table(result))
    print(f"\nwrote {json_path}")
    return result


def format_table(result: dict) -> str:
    mib = lambda b: f"{b / 2**20:.1f}"
    rows = [[r["tp"], " / ".join(str(b) for b in r["kv_bytes_per_token_per_rank"]), r["kv_bytes_per_token_total"],
             r["kv_bytes_per_token_unique"], r["kv_bytes_per_token_duplicated"],
             " / ".join(mib(b) for b in r["weight_bytes_per_rank"]), mib(r["weight_bytes_total"])]
            for r in result["sizes"]]
    text = report.markdown_table(["tp", "KV B/token per rank", "KV B/token total", "unique", "duplicated",
                                  "weights MiB per rank", "weights MiB total"], rows)
    return (f"{result['model']} ({result['architecture']}, {result['dtype']})\n\n" + text +
            "\n\n(duplicated: KV bytes every rank holds alike, e.g. an MLA latent cache; each rank sizes its own "
            "pool from its KV budget, and all keep the smallest block count)")
