"""The continual-learning trainer of `lanner serve --learn-draft DIR` (started by lanner.spec.learn as
`python -m lanner.train.online DIR`; see that module for the folder's layout).

It runs at the lowest CPU priority with its own thread budget (learner.json: threads, default 1), never on the
request path. In rounds, once enough new traffic has arrived:
- the newest `holdout` samples are held back; the student head trains on the new samples before them plus as
  many older ones (replay, so it does not forget), HASS's training-time-test loss against the tokens the target
  emitted (the served output: the target's greedy tokens, or its samples);
- the student and the served head are scored on the held-back slice by the engine's greedy walk replayed on
  their chained predictions (lanner.train.eval_head.score_sequences: tau at the served depth);
- the student is published (DIR/heads/vN, then DIR/current.json) only when its tau beats the served head's.
The student keeps learning either way; its weights and optimizer state survive restarts (DIR/student.pt).
"""
from __future__ import annotations

import copy
import json
import os
import random
import shutil
import sys
import time

import torch

from lanner.spec.draft_head import DraftHead
from lanner.spec.learn import published_head, write_json_atomic

DEFAULTS = {"threads": 1, "lr": 1e-4, "warmup_steps": 10, "grad_accum": 4, "grad_clip": 0.5, "ttt_steps": 4,
            "step_decay": 0.8, "round_samples": 8, "holdout": 16, "window": 512, "max_len": 1024, "keep_heads": 3,
            "poll_s": 2.0, "steps": 3, "bf16": True, "seed": 0}


def load_sample(path: str, max_len: int) -> tuple[torch.Tensor, list[int], int]:
    """-> (target features [T-1, 3h] float32, token ids [T], position of the first response token); the last
    max_len tokens of a longer sample."""
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        feats, ids, loss_from = f.get_tensor("features"), f.get_tensor("ids").tolist(), int(f.metadata()["loss_from"])
    cut = max(0, len(ids) - max_len)
    return feats[cut:].float(), ids[cut:], max(1, loss_from - cut)


class OnlineTrainer:
    def __init__(self, folder: str, **overrides):
        from safetensors.torch import load_file

        self.folder = folder
        with open(os.path.join(folder, "learner.json")) as f:
            self.s = {**DEFAULTS, **json.load(f), **overrides}
        torch.manual_seed(self.s["seed"])
        self.rng = random.Random(self.s["seed"])
        weight = load_file(os.path.join(folder, "embed.safetensors"))["weight"].float()
        self.embed = torch.nn.Embedding.from_pretrained(weight, freeze=True)
        self.served = DraftHead.load(published_head(folder) or self.s["base_head"])
        state_path = os.path.join(folder, "student.pt")
        state = torch.load(state_path, weights_only=False) if os.path.exists(state_path) else None
        self.student = copy.deepcopy(self.served)
        if state is not None:
            self.student.load_state_dict(state["head"])
        self.student.requires_grad_(True).train()
        self.params = [p for p in self.student.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=self.s["lr"], betas=(0.9, 0.95), weight_decay=0.0)
        self.seen, self.version, self.rounds, self.opt_steps = set(), self._published_version(), 0, 0
        if state is not None:
            self.opt.load_state_dict(state["opt"])
            self.seen, self.rounds, self.opt_steps = set(state["seen"]), state["rounds"], state["opt_steps"]
        from lanner.train.hass import target_to_draft

        self.t2d = target_to_draft(self.student, weight.shape[0])

    def _published_version(self) -> int:
        path = published_head(self.folder)
        return int(os.path.basename(path)[1:]) if path else 0

    def traffic(self) -> list[str]:
        folder = os.path.join(self.folder, "traffic")
        return sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))  # names start with the time

    def _load(self, name: str):
        return load_sample(os.path.join(self.folder, "traffic", name), self.s["max_len"])

    def score(self, head, samples) -> dict:
        from lanner.train.eval_head import score_sequences

        return score_sequences(head, self.embed.weight, self.embed.weight.shape[0], samples, self.s["steps"])

    def round(self) -> dict | None:
        """One training round if enough new traffic arrived, else None; -> its record (also in rounds.jsonl)."""
        from lanner.train.hass import ttt_losses

        s = self.s
        window = self.traffic()[-s["window"] :]
        held, trainable = window[-s["holdout"] :], window[: -s["holdout"]]
        fresh = [n for n in trainable if n not in self.seen]
        if len(held) < s["holdout"] or len(fresh) < s["round_samples"]:
            return None
        older = [n for n in trainable if n in self.seen]
        batch = fresh + self.rng.sample(older, min(len(older), len(fresh)))
        self.rng.shuffle(batch)
        t0, tokens, losses, accs = time.perf_counter(), 0, [], []
        self.student.train()
        for i, name in enumerate(batch):
            feats, ids, loss_from = self._load(name)
            t = torch.tensor(ids)
            top_i = torch.cat([t[1:], t.new_zeros(1)])[:, None]  # row p: the token after p (the last: unknown)
            top_p = torch.ones(len(ids), 1, dtype=torch.float16)
            top_p[-1] = 0
            # bf16 autocast: 2.5x the tokens/s of float32 on this CPU (AVX512-BF16); weights and optimizer float32
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=s["bf16"]):
                loss, _, acc = ttt_losses(self.student, self.embed, feats, t, top_i, top_p,
                                          self.t2d, loss_from, s["ttt_steps"], s["step_decay"])
            (loss / s["grad_accum"]).backward()
            tokens += len(ids) - loss_from
            losses.append(loss.item())
            accs.append(acc[0])
            if (i + 1) % s["grad_accum"] == 0 or i + 1 == len(batch):
                for g in self.opt.param_groups:
                    g["lr"] = s["lr"] * min(1.0, (self.opt_steps + 1) / s["warmup_steps"])
                torch.nn.utils.clip_grad_norm_(self.params, s["grad_clip"])
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)
                self.opt_steps += 1
        train_s = time.perf_counter() - t0
        self.seen.update(fresh)
        held_samples = [self._load(n) for n in held]
        served, student = self.score(self.served, held_samples), self.score(self.student, held_samples)
        self.rounds += 1
        publish = student["replay_tau"] > served["replay_tau"]
        record = {"round": self.rounds, "time": time.time(), "samples_seen": len(self.seen),
                  "trained_samples": len(batch), "response_tokens": tokens, "train_s": train_s,
                  "tokens_per_s": tokens / train_s if train_s else None, "loss": sum(losses) / len(losses),
                  "acc0": sum(accs) / len(accs), "holdout": len(held), "served_tau": served["replay_tau"],
                  "student_tau": student["replay_tau"], "served_accept1": served["replay_accept_at"][0],
                  "student_accept1": student["replay_accept_at"][0], "published": publish,
                  "served_version": self.version + int(publish)}
        self._save()
        # current.json, written last by publish, is the commit point: whoever sees it sees this round's record
        with open(os.path.join(self.folder, "rounds.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
        if publish:
            self.publish(record)
        return record

    def publish(self, record: dict):
        self.version += 1
        heads = os.path.join(self.folder, "heads")
        tmp = os.path.join(heads, f".v{self.version}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        self.student.save(tmp)
        os.replace(tmp, os.path.join(heads, f"v{self.version}"))
        write_json_atomic(os.path.join(self.folder, "current.json"),
                          {"version": self.version, "round": self.rounds, "served_tau_before": record["served_tau"],
                           "tau": record["student_tau"]})
        # the served head from now on: bf16 on disk, as the engine loads it
        self.served = DraftHead.load(os.path.join(heads, f"v{self.version}"))
        for name in os.listdir(heads):  # the newest few stay (the engine may be loading the one before)
            if name.startswith("v") and int(name[1:]) <= self.version - self.s["keep_heads"]:
                shutil.rmtree(os.path.join(heads, name), ignore_errors=True)

    def _save(self):
        path = os.path.join(self.folder, "student.pt")
        torch.save({"head": self.student.state_dict(), "opt": self.opt.state_dict(), "seen": sorted(self.seen),
                    "rounds": self.rounds, "opt_steps": self.opt_steps}, path + ".tmp")
        os.replace(path + ".tmp", path)
        # traffic the window has passed stays on disk only as long as needed
        names = self.traffic()
        for name in names[: max(0, len(names) - 2 * self.s["window"])]:
            os.remove(os.path.join(self.folder, "traffic", name))
            self.seen.discard(name)


def main(argv=None):
    folder = (argv or sys.argv[1:])[0]
    with open(os.path.join(folder, "learner.json")) as f:
        settings = {**DEFAULTS, **json.load(f)}
    parent = settings.get("parent_pid")
    try:
        os.nice(19)  # the server's requests come first
    except OSError:
        pass
    torch.set_num_threads(settings["threads"])
    trainer = OnlineTrainer(folder)
    print(f"learn-draft trainer: {folder}, serving v{trainer.version}, {len(trainer.seen)} samples seen",
          flush=True)
    while parent is None or os.getppid() == parent:
        record = trainer.round()
        if record is None:
            time.sleep(settings["poll_s"])
        else:
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C on the server's terminal reaches its whole process group
        pass
