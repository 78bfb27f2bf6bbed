"""Continual learning of the draft head from served traffic (`lanner serve --learn-draft DIR`): the engine side.

The verify forward computes the target's features of every verified position anyway (the head's input). The
learner keeps a bf16 copy of them per request, and when a request completes, writes its features and token ids
to DIR/traffic/ (a writer thread: no disk I/O on the engine loop). A trainer process (lanner.train.online) at
the lowest CPU priority trains a student head on that traffic and publishes it to DIR/heads/ when it accepts
more than the served head on a held-back slice of the most recent traffic; `poll()`, between engine steps, then
copies the published weights into the served head in place (the lowlat kernels read the same tensors).
Verification keeps outputs lossless whatever the head's weights. A restart serves DIR's newest published head
and the trainer resumes its student and optimizer.

DIR layout: learner.json (settings), embed.safetensors (the target's token embedding, the head's input),
traffic/*.safetensors (samples), heads/vN/ (published heads), current.json (the served version), student.pt
(the trainer's state), rounds.jsonl (one line per training round), trainer.log.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
import weakref

import torch

log = logging.getLogger("lanner")

POLL_S = 0.5  # how often the engine looks for a newly published head
MIN_SAMPLE_TOKENS = 8  # shorter completions teach the head nothing


def published_head(folder: str) -> str | None:
    """The folder of DIR's newest published head, or None."""
    try:
        with open(os.path.join(folder, "current.json")) as f:
            return os.path.join(folder, "heads", f"v{json.load(f)['version']}")
    except (OSError, ValueError, KeyError):
        return None


def write_json_atomic(path: str, obj):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


class DraftLearner:
    """Captures the served traffic of a draft head and swaps in the heads the trainer publishes."""

    def __init__(self, folder: str, head, embed_weight: torch.Tensor, settings: dict, spawn: bool = True):
        from safetensors.torch import save_file

        self.folder, self.head = folder, head
        os.makedirs(os.path.join(folder, "traffic"), exist_ok=True)
        os.makedirs(os.path.join(folder, "heads"), exist_ok=True)
        embed_path = os.path.join(folder, "embed.safetensors")
        if not os.path.exists(embed_path):
            save_file({"weight": embed_weight.detach().to(torch.bfloat16).contiguous().cpu()}, embed_path + ".tmp")
            os.replace(embed_path + ".tmp", embed_path)
        settings_path = os.path.join(folder, "learner.json")
        try:  # the trainer's own settings (lr, holdout, ...: lanner.train.online.DEFAULTS) stay as a user set them
            with open(settings_path) as f:
                settings = {**json.load(f), **settings}
        except (OSError, ValueError):
            pass
        write_json_atomic(settings_path, settings)
        self.version = self._current_version()
        self._mtime, self._next_poll = self._stat(), 0.0
        self.buffers: dict[str, tuple[int, list[torch.Tensor]]] = {}  # request id -> (first position, rows)
        self._queue: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="lanner-learn-writer", daemon=True)
        self._writer.start()
        self.trainer: subprocess.Popen | None = None
        if spawn:
            with open(os.path.join(folder, "trainer.log"), "a") as logf:
                self.trainer = subprocess.Popen([sys.executable, "-m", "lanner.train.online", folder],
                                                stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            # the trainer also exits by itself when this process goes (it watches its parent)
            self._finalizer = weakref.finalize(self, _stop, self.trainer)

    # ------------------------------------------------------------------ capture (engine loop)
    def keep(self, req, rows: torch.Tensor):
        """The features of `req`'s positions num_computed.. (this step's verified rows)."""
        at = req.num_computed
        start, kept = self.buffers.get(req.request_id, (at, []))
        have = start + sum(r.shape[0] for r in kept)
        if at != have:  # recomputed after a preemption: keep what precedes it
            if at < start:
                start, kept = at, []
            else:
                kept = [torch.cat(kept)[: at - start]] if kept else []
        kept.append(rows.to(torch.bfloat16, copy=True))
        self.buffers[req.request_id] = (start, kept)

    def finish(self, req, reason: str):
        start, kept = self.buffers.pop(req.request_id, (0, []))
        if reason == "error" or not kept:
            return
        ids = req.all_ids[start:]
        feats = torch.cat(kept)[: len(ids) - 1]  # a stop inside an accepted chain leaves rows past the end
        loss_from = max(0, len(req.prompt_ids) - start)
        if feats.shape[0] != len(ids) - 1 or len(ids) - loss_from < MIN_SAMPLE_TOKENS:
            return
        self._queue.put((feats, ids, loss_from))

    def _write_loop(self):
        from safetensors.torch import save_file

        n = 0
        while True:
            feats, ids, loss_from = self._queue.get()
            name = f"{time.time_ns():020d}-{os.getpid()}-{n:06d}"
            path = os.path.join(self.folder, "traffic", name + ".safetensors")
            try:
                save_file({"features": feats.contiguous(), "ids": torch.tensor(ids, dtype=torch.int32)},
                          path + ".tmp", metadata={"loss_from": str(loss_from)})
                os.replace(path + ".tmp", path)  # the trainer never sees a partial file
            except OSError as e:
                log.warning("learn-draft: could not write a traffic sample: %s", e)
            n += 1
            self._queue.task_done()

    def flush(self):
        """Waits until every completed request's sample is on disk."""
        self._queue.join()

    # ------------------------------------------------------------------ hot swap (engine loop, between steps)
    def _stat(self) -> int:
        try:
            return os.stat(os.path.join(self.folder, "current.json")).st_mtime_ns
        except OSError:
            return 0

    def _current_version(self) -> int:
        try:
            with open(os.path.join(self.folder, "current.json")) as f:
                return int(json.load(f)["version"])
        except (OSError, ValueError, KeyError):
            return 0

    def poll(self, force: bool = False) -> bool:
        """Swaps in a newly published head; -> whether it did."""
        now = time.monotonic()
        if not force and now < self._next_poll:
            return False
        self._next_poll = now + POLL_S
        mtime = self._stat()
        if mtime == self._mtime:
            return False
        self._mtime = mtime
        version = self._current_version()
        if version <= self.version:
            return False
        return self.swap(os.path.join(self.folder, "heads", f"v{version}"), version)

    @torch.inference_mode()
    def swap(self, path: str, version: int) -> bool:
        from safetensors.torch import load_file

        try:
            new = load_file(os.path.join(path, "model.safetensors"))
        except (OSError, ValueError) as e:
            log.warning("learn-draft: head v%d unreadable, keeping v%d: %s", version, self.version, e)
            return False
        own = self.head.state_dict()
        if new.keys() != own.keys() or any(new[k].shape != v.shape for k, v in own.items()) or \
                not torch.equal(new["d2t"].to(own["d2t"]), own["d2t"]):
            log.warning("learn-draft: head v%d does not fit the served head (shape or vocabulary); not swapped",
                        version)
            return False
        for k, v in own.items():  # in place: every path that runs the head reads these tensors
            v.copy_(new[k])
        log.info("learn-draft: serving head v%d (was v%d)", version, self.version)
        self.version = version
        return True

    def close(self):
        self.flush()
        if self.trainer is not None:
            self._finalizer()


def _stop(proc: subprocess.Popen):
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
