"""The real coding agents against `lanner serve` (issue 43, item 7; outside CI; docs/agents.md).

Runs Codex CLI (`codex exec`, Responses API) and Claude Code (`claude -p`, Messages API) on one small file-edit
task each, in a scratch git repository, against a Lanner server on a real model. Between the agent and the
server sits a recording proxy: per request it keeps the route, status, prompt / cached / output tokens from the
usage the server reports, the tool calls the model made, the time to the response headers (the server sends
them after the first token, so this is TTFT) and the whole time. The results file holds, per agent: started,
tool calls made, protocol errors, task solved (calc.py prints 5), the diff, prompt tokens, TTFT, cache hits and
wall time.

    python tools/agents_e2e.py [--agents codex,claude] [--model qwen2.5-coder-1.5b] [--threads 1]
        [--out results/agents_e2e.json]

Clients: `npm install --prefix /tmp/agents_npm @openai/codex@0.169.0 @anthropic-ai/claude-code@2.1.328` (done
by the script when missing). Nothing leaves the machine: telemetry, updates and error reports are switched off.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

TASK = "In calc.py, fix the bug in add() so that it returns a + b."
# --task explicit: a small model answers TASK with the fixed code as text; naming the tool and the command helps
EXPLICIT = ("Fix the bug in calc.py: add() must return a + b. Call your shell tool with this exact command: "
            "sed -i 's/a - b/a + b/' calc.py && python3 calc.py")
CALC = "def add(a, b):\n    return a - b\n\n\nprint(add(2, 3))\n"
PACKAGES = {"codex": "@openai/codex@0.169.0", "claude": "@anthropic-ai/claude-code@2.1.328"}


# ---------------------------------------------------------------------------------------------- recording proxy
class Recorder:
    def __init__(self, upstream: str):
        self.upstream, self.records, self.lock = upstream, [], threading.Lock()
        self.bodies: Path | None = None  # where each request's body is kept (the agent's folder, requests/)

    def add(self, rec: dict):
        with self.lock:
            self.records.append(rec)


def sse_summary(raw: bytes) -> dict:
    """Usage and tool calls out of a Responses or Messages stream (or a JSON body)."""
    out = {"input_tokens": None, "cached_tokens": None, "output_tokens": None, "tool_calls": [], "text": "",
           "error": None}
    datas = [line[6:] for line in raw.decode("utf-8", "replace").splitlines() if line.startswith("data: ")]
    if not datas:
        try:
            datas = [raw.decode()]
        except UnicodeDecodeError:
            return out
    for d in datas:
        try:
            ev = json.loads(d)
        except ValueError:
            continue
        kind = ev.get("type")
        if kind in ("response.completed", "response.incomplete") or ev.get("object") == "response":
            resp = ev.get("response", ev)
            u = resp.get("usage") or {}
            out.update(input_tokens=u.get("input_tokens"), output_tokens=u.get("output_tokens"),
                       cached_tokens=(u.get("input_tokens_details") or {}).get("cached_tokens"))
            for item in resp.get("output", []):
                if item.get("type") == "function_call":
                    out["tool_calls"].append({"name": item["name"], "arguments": item["arguments"]})
                elif item.get("type") == "message":
                    out["text"] += "".join(c.get("text", "") for c in item.get("content", []))
        elif kind == "message_start":
            u = ev["message"]["usage"]
            out.update(input_tokens=u.get("input_tokens", 0) + (u.get("cache_read_input_tokens") or 0),
                       cached_tokens=u.get("cache_read_input_tokens"))
        elif kind == "content_block_start" and ev["content_block"]["type"] == "tool_use":
            out["tool_calls"].append({"name": ev["content_block"]["name"], "arguments": ""})
        elif kind == "content_block_delta":
            delta = ev["delta"]
            if delta["type"] == "input_json_delta":
                out["tool_calls"][-1]["arguments"] += delta["partial_json"]
            elif delta["type"] == "text_delta":
                out["text"] += delta["text"]
        elif kind == "message_delta":  # the final usage: message_start goes out before the prefill
            u = ev.get("usage", {})
            out["output_tokens"] = u.get("output_tokens")
            if u.get("input_tokens") is not None:  # Anthropic counts input after the cache
                cached = u.get("cache_read_input_tokens") or 0
                out.update(input_tokens=u["input_tokens"] + cached, cached_tokens=cached)
            out["stop_reason"] = ev["delta"].get("stop_reason")
        elif kind == "error" or "error" in ev and kind is None:
            out["error"] = ev.get("error") or ev.get("message")
    out["text"] = out["text"][:400]
    return out


def proxy_handler(rec: Recorder):
    host, port = rec.upstream.split("//")[1].split(":")

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _forward(self):
            t0 = time.monotonic()
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            if rec.bodies is not None and body:  # to replay a request against a changed server
                rec.bodies.mkdir(exist_ok=True)
                (rec.bodies / f"{len(list(rec.bodies.iterdir())):03d}.json").write_bytes(body)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
            conn = http.client.HTTPConnection(host, int(port), timeout=7200)
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            t_headers = time.monotonic()
            self.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                    self.send_header(k, v)
            self.send_header("connection", "close")
            self.end_headers()
            raw, t_token, client_closed = bytearray(), None, None
            while chunk := resp.read1(65536):
                raw += chunk
                # the first token: a text or tool-call delta (streams open before it, at the server's admission)
                if t_token is None and b'_delta"' in chunk:
                    t_token = time.monotonic()
                try:
                    self.wfile.write(chunk)
                    self.wfile.flush()
                except ConnectionError:
                    client_closed = round(time.monotonic() - t0, 2)  # the agent gave up on this request
                    break
            conn.close()
            summary = sse_summary(bytes(raw)) if self.command == "POST" else {}
            rec.add({"method": self.command, "path": self.path, "status": resp.status,
                     "request_bytes": len(body), "headers_s": round(t_headers - t0, 2),
                     "ttft_s": None if t_token is None else round(t_token - t0, 2), "client_closed_s": client_closed,
                     "total_s": round(time.monotonic() - t0, 2), **summary,
                     **({"error_body": raw.decode("utf-8", "replace")[:1000]} if resp.status >= 400 else {})})

        do_GET = do_POST = _forward

    return Handler


def start_proxy(rec: Recorder) -> tuple[ThreadingHTTPServer, str]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), proxy_handler(rec))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


# ---------------------------------------------------------------------------------------------- server
def start_server(args, log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    cmd = [sys.executable, "-m", "lanner", "serve", "--model", args.model, "--port", str(args.port),
           "--max-model-len", str(args.max_model_len), "--served-model-name", args.served_name,
           "--plugin-option", f"lowlat.threads={args.threads}", *args.server_arg]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited ({proc.returncode}); see {log}")
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{args.port}/health", timeout=5).status == 200:
                return proc
        except OSError:
            pass
        time.sleep(2)
    proc.terminate()
    raise SystemExit("server did not become healthy in 600 s")


def metrics(base: str) -> dict[str, float]:
    try:
        text = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith(("lanner_prompt_tokens", "lanner_prefix_cache_hit_tokens", "lanner_generation_tokens",
                            "lanner_requests_finished", "lanner_time_to_first_token_seconds_sum",
                            "lanner_time_to_first_token_seconds_count")) and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name] = out.get(name, 0.0) + float(value)
    return out


# ---------------------------------------------------------------------------------------------- agents
def scratch_repo(root: Path) -> Path:
    repo = root / "repo"
    subprocess.run(["rm", "-rf", str(repo)], check=True)
    repo.mkdir(parents=True)
    (repo / "calc.py").write_text(CALC)
    git = ["git", "-c", "user.email=e2e@lanner", "-c", "user.name=e2e"]
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "."], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "calc.py with a bug"], cwd=repo, check=True)
    return repo


QUIET = {"DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
         "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_BUG_COMMAND": "1",
         "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1", "NO_UPDATE_NOTIFIER": "1"}


def codex_command(args, root: Path, base: str, repo: Path) -> tuple[list[str], dict]:
    home = root / "codex_home"
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(f"""model = "{args.served_name}"
model_provider = "lanner"
model_context_window = {args.max_model_len}
model_reasoning_summary = "none"
check_for_update_on_startup = false
[analytics]
enabled = false
[model_providers.lanner]
name = "Lanner"
base_url = "{base}/v1"
wire_api = "responses"
env_key = "LANNER_API_KEY"
request_max_retries = 0
stream_max_retries = 0
stream_idle_timeout_ms = {args.agent_timeout * 1000}
""")
    env = {**os.environ, **QUIET, "CODEX_HOME": str(home), "LANNER_API_KEY": "sk-dummy"}
    cmd = [str(Path(args.npm_prefix) / "node_modules/.bin/codex"), "exec", "--json", "--skip-git-repo-check",
           "--dangerously-bypass-approvals-and-sandbox", "-C", str(repo), args.task]
    return cmd, env


def claude_command(args, root: Path, base: str, repo: Path) -> tuple[list[str], dict]:
    home = root / "claude_home"
    home.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANTHROPIC_")}
    env.update(QUIET, HOME=str(home), CLAUDE_CONFIG_DIR=str(home / ".claude"), ANTHROPIC_BASE_URL=base,
               ANTHROPIC_API_KEY="sk-dummy", ANTHROPIC_MODEL=args.served_name,
               ANTHROPIC_SMALL_FAST_MODEL=args.served_name, ANTHROPIC_DEFAULT_HAIKU_MODEL=args.served_name,
               ANTHROPIC_DEFAULT_SONNET_MODEL=args.served_name, ANTHROPIC_DEFAULT_OPUS_MODEL=args.served_name,
               API_TIMEOUT_MS=str(args.agent_timeout * 1000), CLAUDE_CODE_MAX_OUTPUT_TOKENS=str(args.max_output))
    # --dangerously-skip-permissions is refused under root; allowing the edit tools does the same here
    cmd = [str(Path(args.npm_prefix) / "node_modules/.bin/claude"), "-p", args.task, "--output-format", "stream-json",
           "--verbose", "--max-turns", str(args.max_turns), "--permission-mode", "acceptEdits",
           "--allowedTools", "Read,Edit,Write,Bash,Glob,Grep"]
    return cmd, env


AGENTS = {"codex": codex_command, "claude": claude_command}


def run_agent(name: str, args, root: Path, rec: Recorder, server: str) -> dict:
    root = root / name
    root.mkdir(parents=True, exist_ok=True)
    repo = scratch_repo(root)
    srv, base = start_proxy(rec)
    rec.bodies = root / "requests"
    cmd, env = AGENTS[name](args, root, base, repo)
    first = len(rec.records)
    before = metrics(server)
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=args.agent_timeout,
                           stdin=subprocess.DEVNULL)
        rc, stdout, stderr = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, stdout, stderr = "timeout", e.stdout or "", e.stderr or ""
        stdout, stderr = [s.decode() if isinstance(s, bytes) else s for s in (stdout, stderr)]
    wall = time.monotonic() - t0
    srv.shutdown()
    after = metrics(server)
    (root / "stdout.jsonl").write_text(stdout)
    (root / "stderr.txt").write_text(stderr)
    reqs = rec.records[first:]
    run = subprocess.run([sys.executable, "calc.py"], cwd=repo, capture_output=True, text=True)
    diff = subprocess.run(["git", "diff"], cwd=repo, capture_output=True, text=True).stdout
    calls = [c for r in reqs for c in r.get("tool_calls", [])]
    turns = [r for r in reqs if r["method"] == "POST"]
    return {
        "agent": name, "command": " ".join(cmd[:1] + [a if " " not in a else repr(a) for a in cmd[1:]]),
        "exit_code": rc, "wall_s": round(wall, 1),
        "started": bool(turns),
        "requests": len(turns),
        "tool_calls_made": len(calls), "tool_calls": calls,
        "protocol_errors": [{"path": r["path"], "status": r["status"], "body": r.get("error_body") or r["error"]}
                            for r in reqs if r["status"] >= 400 or r.get("error")],
        "task_solved": run.stdout.strip() == "5", "calc_output": (run.stdout + run.stderr).strip()[-300:],
        "diff": diff,
        "prompt_tokens": [r["input_tokens"] for r in turns], "cached_tokens": [r["cached_tokens"] for r in turns],
        "output_tokens": [r["output_tokens"] for r in turns], "ttft_s": [r["ttft_s"] for r in turns],
        "headers_s": [r["headers_s"] for r in turns], "client_closed_s": [r["client_closed_s"] for r in turns],
        "request_s": [r["total_s"] for r in turns],
        "metrics_delta": {k: round(after.get(k, 0) - before.get(k, 0), 3) for k in after},
        "turns": reqs, "stderr_tail": stderr[-1500:], "stdout_tail": stdout[-1500:],
    }


def ensure_clients(args):
    missing = [PACKAGES[a] for a in args.agents
               if not (Path(args.npm_prefix) / "node_modules/.bin" / a).exists()]
    if missing:
        subprocess.run(["npm", "install", "--prefix", args.npm_prefix, *missing], check=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", default="codex,claude", type=lambda s: s.split(","))
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--task", default=TASK, help=f"the ask; 'explicit': {EXPLICIT!r}")
    ap.add_argument("--served-name", default="qwen2.5-coder-1.5b")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--port", type=int, default=18800)
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--server-arg", action="append", default=[], help="more `lanner serve` arguments")
    ap.add_argument("--server", help="use this running server (http://host:port) instead of starting one")
    ap.add_argument("--npm-prefix", default="/tmp/agents_npm")
    ap.add_argument("--work", default="/tmp/agents_e2e")
    ap.add_argument("--agent-timeout", type=int, default=1800, help="seconds per agent run and per request")
    ap.add_argument("--max-turns", type=int, default=8, help="Claude Code's --max-turns")
    ap.add_argument("--max-output", type=int, default=2048, help="Claude Code's CLAUDE_CODE_MAX_OUTPUT_TOKENS")
    ap.add_argument("--no-wait", action="store_true", help="do not wait while /tmp/bench_busy exists")
    ap.add_argument("--out", default="results/agents_e2e.json")
    args = ap.parse_args(argv)
    args.task = EXPLICIT if args.task == "explicit" else args.task
    ensure_clients(args)
    root = Path(args.work)
    root.mkdir(parents=True, exist_ok=True)
    while not args.no_wait and Path("/tmp/bench_busy").exists():
        time.sleep(10)
    proc = None
    server = args.server
    if server is None:
        t0 = time.monotonic()
        proc = start_server(args, root / "server.log")
        print(f"server up in {time.monotonic() - t0:.0f} s", flush=True)
        server = f"http://127.0.0.1:{args.port}"
    rec = Recorder(server)
    out = Path(args.out)  # runs add to the file: key "<agent>" for TASK, "<agent>_explicit" for EXPLICIT
    results = json.loads(out.read_text()) if out.exists() else {}
    results.update(model=args.model, threads=args.threads, max_model_len=args.max_model_len,
                   tasks={"default": TASK, "explicit": EXPLICIT})
    results.setdefault("agents", {})
    try:
        for name in args.agents:
            print(f"running {name} ...", flush=True)
            r = run_agent(name, args, root, rec, server)
            r["task"] = args.task
            results["agents"][name + ("_explicit" if args.task == EXPLICIT else "")] = r
            print(json.dumps({k: r[k] for k in ("started", "requests", "tool_calls_made", "task_solved", "wall_s",
                                                "prompt_tokens", "cached_tokens", "ttft_s")}), flush=True)
            out.write_text(json.dumps(results, indent=1) + "\n")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    return results


if __name__ == "__main__":
    main()
