"""Time per decode step of a KV system under TP=2 (gloo) on the tiny GLM-5 architecture, with a cProfile of rank 0.

    OMP_NUM_THREADS=1 python tools/kv_tp_step.py ula-tp 9      # or: hisparse 9 (HiSparse under TP)

Random bf16 GLM-5-architecture model (index_topk 64), 2048-token prompts, `batch` requests admitted, 2 warm-up
steps, then 8 timed steps; per-rank budgets 1.5 MiB device / 15 MiB host (what `lanner bench kv capacity
--kv-model glm-tiny --device-gb 0.003 --host-gb 0.03` gives each rank). Prints the mean step time and the 25
costliest functions on rank 0 (collective waits show as `wait`).
"""
from __future__ import annotations

import cProfile
import io
import os
import pstats
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, port, folder, out, system, batch):
    from lanner.bench.kv_capacity import load_tiny, mla_prompts
    from lanner.distributed import destroy_tp, init_tp
    from lanner.kvcache.ula.mla_decoder import MlaDecoder, mla_entry_shape
    from lanner.kvcache.ula import make_backend

    torch.set_num_threads(1)
    init_tp(rank, 2, f"tcp://127.0.0.1:{port}", timeout_s=300)
    try:
        model = load_tiny(folder, torch.bfloat16)
        group = dist.new_group(backend="gloo")
        g = torch.Generator().manual_seed(0)
        docs = [torch.randint(2, 160, (2048,), generator=g).tolist() for _ in range(2)]
        max_len = 2048 + 64
        prompts = mla_prompts(model, docs, max_len)
        cache = make_backend(system, mla_entry_shape(model), torch.bfloat16, 0.0015, 0.015,
                             hisparse_buffer=2 * 64 * 2, tp_buffer=0.5, group=group)
        dec = MlaDecoder(model, cache, max_len)
        logits = {}
        for i in range(batch):
            dec.add(i, prompts[i % 2], max_len)
            logits[i] = prompts[i % 2].logits
        rids = list(range(batch))

        def step():
            for r, row in zip(rids, dec.step(rids, [int(logits[r].argmax()) for r in rids])):
                logits[r] = row

        for _ in range(2):
            step()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(8):
            step()
        prof.disable()
        dt = (time.perf_counter() - t0) / 8
        if rank == 0:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
            with open(out, "w") as f:
                f.write(f"{system} batch {batch}: {dt * 1e3:.1f} ms per step\n" + s.getvalue())
    finally:
        destroy_tp()


def main():
    from lanner.models.tiny import make_tiny_model

    system, batch = sys.argv[1], int(sys.argv[2])
    with tempfile.TemporaryDirectory() as folder:
        make_tiny_model("glm_moe_dsa", folder, index_topk=64, max_position_embeddings=2200)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = os.path.join(folder, "profile.txt")
        mp.start_processes(worker, args=(port, folder, out, system, batch), nprocs=2, start_method="fork", join=True)
        with open(out) as f:
            print(f.read())


if __name__ == "__main__":
    main()
