"""The wheel, installed outside the checkout, is a complete Lanner: it carries every file git tracks under lanner/
(C++ sources, draft heads, bench data), and LLM() serves a request with its default speculation (hybrid: suffix
index + draft head, each compiled or loaded from the installed package's own files). It runs without kernel plugins:
lowlat's compile from a new path takes ~70 s on 2 cores, and its sources are among the files the wheel is checked
to carry.

The wheel is built from a copy of the tracked files, not from the checkout itself: an in-tree build writes build/
and *.egg-info into the checkout, and a stale build/lib from an earlier build would put a file into the wheel that
package-data no longer names."""
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Run in the installed copy: asserts it is the one imported, then one greedy request on a prompt that repeats its
# text, so the suffix index (spec/csrc/suffix.cpp) finds matches and drafts from them.
SERVE = """
import json, os, sys
import lanner
from lanner import LLM, SamplingParams

llm = LLM(plugin=None)
line = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu. "
prompt = "Repeat the following line ten times.\\n" + line * 6
out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=32))[0]
print(json.dumps({"file": os.path.realpath(lanner.__file__), "spec": llm.engine.config.spec, "text": out.text,
                  "error": out.error, "steps": out.metrics["spec_verify_steps"],
                  "drafted": out.metrics["spec_draft_tokens"]}))
llm.close()
"""


def tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", "lanner", "pyproject.toml", "README.md"], cwd=REPO,
                             capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"needs a git checkout to know the tracked files ({e})")
    return [f for f in out.decode().split("\0") if f]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("packaging")
    files = tracked_files()
    for f in files:
        (tmp / "src" / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, tmp / "src" / f)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp / "dist"), str(tmp / "src")], check=True)
    (path,) = (tmp / "dist").glob("lanner-*.whl")
    return path, files


def test_wheel_carries_every_tracked_data_file(wheel):
    path, files = wheel
    with zipfile.ZipFile(path) as z:
        shipped = set(z.namelist())
    data = [f for f in files if f.startswith("lanner/") and not f.endswith(".py")]
    assert data, "no tracked data files under lanner/"
    missing = [f for f in data if f not in shipped]
    assert not missing, f"the wheel lacks (pyproject's package-data): {missing}"


def test_installed_wheel_serves_default_speculation(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                    str(wheel[0])], check=True)
    # a private extension cache: the checkout's tests compile the same sources from other paths, and sharing
    # torch's cache would make each rebuild after the other (ninja sees the changed source path)
    env = {**os.environ, "PYTHONPATH": str(site), "TORCH_EXTENSIONS_DIR": str(tmp_path / "torch_extensions")}
    t0 = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", SERVE], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"installed wheel: LLM() and one request in {time.perf_counter() - t0:.0f} s")
    assert result["file"].startswith(str(site.resolve()) + os.sep), result["file"]
    assert result["spec"] == "hybrid"
    assert result["error"] is None and result["text"].strip()
    assert result["steps"] > 0 and result["drafted"].get("suffix", 0) > 0, result
