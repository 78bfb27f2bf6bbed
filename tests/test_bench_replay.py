"""`lanner bench replay`, `bench fixed` and `bench make-sessions`: session files, the generator, and real
(tiny) runs on the default model."""
import json

import pytest

from lanner.bench import compare, fixed, replay, sessions
from lanner.cli import build_parser, engine_kwargs

GOOD = json.dumps({"id": "ok", "turns": [{"role": "user", "content": "hi"},
                                         {"role": "assistant", "content": "hello", "max_tokens": 4}]})

# 2 sessions x 2 assistant turns, 4 tokens each; one session has a tool turn, one a system prompt
TINY = [
    {"id": "a", "turns": [{"role": "user", "content": "Write a haiku about rain."},
                          {"role": "assistant", "content": "Rain taps on the roof.", "max_tokens": 4},
                          {"role": "tool", "content": "$ wc -w haiku.txt\n5 haiku.txt"},
                          {"role": "assistant", "content": "Done.", "max_tokens": 4}]},
    {"id": "b", "turns": [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": "Name a color."},
                          {"role": "assistant", "content": "Blue.", "max_tokens": 4},
                          {"role": "user", "content": "Another one?"},
                          {"role": "assistant", "content": "Red.", "max_tokens": 4}]},
]


def bench_args(*argv):
    """`lanner bench ...` in float32 and, unless argv names a plugin, with plugin=None (the engine's own forward,
    which the shared engine below runs)."""
    args = build_parser().parse_args(["bench", *argv, "--dtype", "float32"])
    if "--plugin" not in argv:
        args.plugin = None
    return args, engine_kwargs(args)


@pytest.fixture(scope="module")
def llm():
    """Loading the model is most of these tests' time, so the plain float32 system's engine is loaded once:
    benchmark runs get it for their plugin=None system (compare._load is patched); any other system, such as
    the --compare one, still loads its own engine."""
    from lanner import LLM

    shared = LLM(**bench_args("fixed")[1])
    real = compare._load
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compare, "_load", lambda name, options: shared if options["plugin"] is None and
                   options["dtype"] == "float32" else real(name, options))
        yield shared


@pytest.fixture(scope="module")
def tokenizer(llm):
    return llm.tokenizer


# ------------------------------------------------------------------ session files

@pytest.mark.parametrize("line, message", [
    ('{"id": "x", "turns": [{"role": "robot", "content": "hi"}]}', "turns[0].role: expected one of"),
    ('{"id": "x", "turns": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}',
     "turns[1].max_tokens: required on assistant turns"),
    (('{"id": "x", "turns": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", '
      '"max_tokens": 0}]}'), "turns[1].max_tokens: expected a positive integer"),
    ('{"id": "x", "turns": [{"role": "user", "content": "hi", "max_tokens": 3}]}',
     "turns[0].max_tokens: only assistant turns"),
    ('{"id": "x", "turns": [{"role": "user", "content": "hi"}]}', "turns: no assistant turn"),
    ('{"id": "x", "turns": [{"role": "user"', "not valid JSON"),
    (GOOD, "id: 'ok' is already used on line 1"),
])
def test_session_file_errors_name_file_line_and_field(tmp_path, line, message):
    path = tmp_path / "s.jsonl"
    path.write_text(GOOD + "\n\n" + line + "\n")  # the bad session is on line 3
    with pytest.raises(sessions.SessionFileError) as e:
        sessions.load_sessions(str(path))
    assert str(e.value).startswith(f"{path}:3: ")
    assert message in str(e.value)


def test_bad_session_file_is_a_clean_cli_error(tmp_path, capsys):
    from lanner.cli import main

    path = tmp_path / "s.jsonl"
    path.write_text(GOOD + "\n" + GOOD.replace('"assistant"', '"bot"') + "\n")
    with pytest.raises(SystemExit) as e:
        main(["bench", "replay", "--sessions", str(path)])
    assert str(e.value).startswith(f"lanner: error: {path}:2: turns[1].role")


@pytest.mark.parametrize("command", ["replay", "fixed", "make-sessions"])
def test_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["bench", command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: lanner bench {command}") and len(out.split("\n\n")[1]) > 100


def test_shipped_sample():
    loaded = sessions.load_sessions(sessions.DEFAULT_SESSIONS)
    ids = [s["id"] for s in loaded]
    assert len(ids) == 8
    assert [i.split("/")[0] for i in ids] == ["humaneval", "sharegpt"] * 4
    for s in loaded:
        assistant = [t for t in s["turns"] if t["role"] == "assistant"]
        assert 3 <= len(assistant) <= 6
        assert all(16 <= t["max_tokens"] <= 256 for t in assistant)
    assert sessions.load_sessions(sessions.DEFAULT_SESSIONS, limit=3) == loaded[:3]


def test_tool_turn_is_a_user_message_when_the_template_has_no_tool_role(tokenizer):
    assert not sessions.has_tool_role(tokenizer)  # SmolLM2's template
    prompts = sessions.assistant_prompts(TINY[0], tokenizer, tag="t")
    assert [n for _, n, _ in prompts] == [4, 4]
    text = tokenizer.decode(prompts[1][0], skip_special_tokens=False)
    assert "<|im_start|>user\n[t] Write a haiku" in text
    assert "<|im_start|>assistant\nRain taps on the roof.<|im_end|>" in text  # the recorded reply
    assert "<|im_start|>user\nTool output:\n$ wc -w haiku.txt" in text
    assert text.endswith("<|im_start|>assistant\n")


# ------------------------------------------------------------------ the generator

def test_generator_builds_valid_agent_sessions(tokenizer, tmp_path):
    made = sessions.make_sessions(tokenizer, humaneval=2, sharegpt=1, seed=3)
    path = tmp_path / "made.jsonl"
    sessions.write_sessions(str(path), made)
    assert sessions.load_sessions(str(path)) == made  # valid by the file format's own checks
    assert [s["id"].split("/")[0] for s in made] == ["humaneval", "sharegpt", "humaneval"]
    for s in made:
        roles = [t["role"] for t in s["turns"]]
        assistant = [t for t in s["turns"] if t["role"] == "assistant"]
        assert 3 <= len(assistant) <= 6 and roles[-1] == "assistant"
        for t in assistant:
            n = len(tokenizer.hf.encode(t["content"], add_special_tokens=False))
            assert t["max_tokens"] == min(max(n, 16), 256)
        assert all(len(ids) <= 1500 for ids, _, _ in sessions.assistant_prompts(s, tokenizer))
        if s["id"].startswith("humaneval/"):
            assert roles[:2] == ["system", "user"]
            tools = [t["content"] for t in s["turns"] if t["role"] == "tool"]
            failing = [t for t in tools if "Traceback (most recent call last)" in t]
            assert failing and all("[exit code 1]" in t and 'File "test_solution.py"' in t for t in failing)
            assert "all tests passed\n[exit code 0]" in tools[-1]
            assert any("```python" in t["content"] for t in assistant)
            assert any("```diff" in t["content"] for t in assistant)
        else:
            assert roles == ["user", "assistant"] * len(assistant)


def test_source_sessions_read_and_edit_real_modules(tokenizer):
    """--source: each session reads a real installed module (the tool turn is its head, on whole lines) and its
    recorded answers are three of its own functions, the first given a docstring; histories fit the limit."""
    import ast
    import sysconfig
    from pathlib import Path

    made = sessions.make_sessions(tokenizer, 0, 0, seed=1, max_prompt_tokens=4096, source=2, max_file_tokens=2500)
    assert len(made) == 2 and len({s["id"] for s in made}) == 2
    for s in made:
        assert [t["role"] for t in s["turns"]] == ["system", "user", "assistant", "tool", "assistant", "user",
                                                   "assistant", "user", "assistant"]
        path = Path(sysconfig.get_paths()["purelib"]) / s["id"].removeprefix("source-")
        text, shown = path.read_text(), s["turns"][3]["content"]
        assert text.startswith(shown) and shown.endswith("\n") and len(shown) > 1000
        answers = [t["content"].removeprefix("```python\n").removesuffix("```") for t in s["turns"][4::2]]
        assert answers[1] in shown and answers[2] in shown  # the functions as the file has them
        assert ast.get_docstring(ast.parse(answers[0]).body[0])  # the docstring added to a function without
        lines = answers[0].splitlines(keepends=True)
        assert [i for i in range(len(lines)) if "".join(lines[:i] + lines[i + 1:]) in shown] == [
            next(i for i, line in enumerate(lines) if '"""' in line)]
        assert all(len(ids) <= 4096 for ids, _, _ in sessions.assistant_prompts(s, tokenizer))


# ------------------------------------------------------------------ real runs

@pytest.fixture(scope="module")
def replay_result(llm, tmp_path_factory):
    """One replay on the tiny file at concurrency 1,2, with --compare: plugin None vs "none", the same system
    twice, in 2 rounds."""
    folder = tmp_path_factory.mktemp("replay")
    path = folder / "tiny.jsonl"
    sessions.write_sessions(str(path), TINY)
    args, options = bench_args("replay", "--sessions", str(path), "--concurrency", "1,2", "--compare", "none",
                               "--rounds", "2", "--json", str(folder / "r.json"), "--png", str(folder / "chart.png"))
    return replay.run(args, options), folder


def test_replay_generates_every_turn(replay_result, capsys):
    result, folder = replay_result
    assert result["num_sessions"] == 2 and result["assistant_turns"] == 4
    rows = [r for r in result["levels"] if r["system"] == "none"]
    assert [r["concurrency"] for r in rows] == [1, 2]
    for r in rows:
        assert r["turns"] == 4 and r["output_tokens"] == 16
        assert sorted((q["session"], q["turn"]) for q in r["requests"]) == [("a", 1), ("a", 2), ("b", 1), ("b", 2)]
        assert all(q["output_tokens"] == q["max_tokens"] == 4 for q in r["requests"])  # EOS ignored
        # later turns grow the context and find the earlier turn's prefix in the cache
        later = [q for q in r["requests"] if q["turn"] == 2]
        assert all(q["cached_prompt_tokens"] > 0 for q in later)
        assert r["speed_p10_tok_s"] <= r["speed_p50_tok_s"] and r["speed_p10_tok_s"] > 0
        assert 0 < r["ttft_p50_s"] <= r["ttft_p90_s"] and r["wall_s"] > 0
    assert json.loads((folder / "r.json").read_text())["levels"][0]["turns"] == 4
    assert (folder / "chart.png").stat().st_size > 0


def test_replay_compare_runs_two_systems_with_identical_greedy_tokens(replay_result):
    result, _ = replay_result
    assert [(s["name"], s["plugin"]) for s in result["systems"]] == [("none", None), ("none #2", "none")]
    assert sorted((r["system"], r["concurrency"]) for r in result["levels"]) == [
        ("none", 1), ("none", 2), ("none #2", 1), ("none #2", 2)]
    comp = result["comparison"]
    assert [c["concurrency"] for c in comp] == [1, 2]
    for r in result["levels"]:  # the medians of 2 rounds: their mean, each round's value kept
        values = r["round_values"]["speed_p50_tok_s"]
        assert len(values) == 2 and r["speed_p50_tok_s"] == pytest.approx(sum(values) / 2)
    for c in comp:
        assert c["speed_p50_tok_s_ratio"] > 0 and c["speed_p10_tok_s_ratio"] > 0
        assert len(c["speed_p50_tok_s_ratio_by_round"]) == 2 and all(x > 0 for x in c["speed_p50_tok_s_ratio_by_round"])
        # the driver's scheduling does not depend on timing: the same system twice is the same computation
        assert c["greedy_identical_turns"] == c["turns"] == 4


def test_bench_fixed(llm, tmp_path):
    out = tmp_path / "fixed.json"
    args, options = bench_args("fixed", "--input", "32", "--output", "4", "--concurrency", "1,2",
                               "--json", str(out))
    fixed.run(args, options)
    data = json.loads(out.read_text())
    assert data["benchmark"] == "fixed" and data["input_tokens"] == 32 and data["output_tokens"] == 4
    assert [(r["system"], r["concurrency"], r["turns"]) for r in data["levels"]] == [("none", 1, 4), ("none", 2, 4)]
    requests = [q for r in data["levels"] for q in r["requests"]]
    assert all(q["prompt_tokens"] == 32 and q["output_tokens"] == 4 for q in requests)
    assert all(q["cached_prompt_tokens"] == 0 for q in requests)  # every prompt differs
    for r in data["levels"]:
        assert r["output_tok_s"] > 0 and r["speed_p50_tok_s"] > 0 and r["ttft_p90_s"] > 0
    assert "comparison" not in data
    assert (tmp_path / "fixed.png").stat().st_size > 0


def test_spec_systems_name_trees_and_the_peer():
    got = dict(compare.systems({"spec": "auto", "spec_tree": 0}, None, "none,suffix,suffix-tree,hybrid-tree"))
    assert (got["none"]["spec"], got["none"]["spec_tree"]) == (None, 0)
    assert (got["suffix"]["spec"], got["suffix"]["spec_tree"]) == ("suffix", 0)
    assert (got["suffix-tree"]["spec"], got["suffix-tree"]["spec_tree"]) == ("suffix", 12)
    assert got["hybrid-tree"]["draft"] == "default" and got["hybrid-tree"]["spec_tree"] == 12
    assert dict(compare.systems({"spec_tree": 20}, None, "suffix-tree"))["suffix-tree"]["spec_tree"] == 20
    with pytest.raises(SystemExit, match="spec_tree"):
        compare.systems({"spec_tree": 40}, None, "suffix-tree")
    got = dict(compare.systems({"spec": "auto", "spec_tree": 0}, None, "none,draft-tree,llama.cpp"))
    assert (got["draft-tree"]["spec"], got["draft-tree"]["draft"]) == ("draft", "default")
    assert got["llama.cpp"] == {"peer": "llama.cpp", "flash_attn": False}
    assert dict(compare.systems({}, None, "none,llama.cpp-fa"))["llama.cpp-fa"] == {"peer": "llama.cpp",
                                                                                     "flash_attn": True}
    with pytest.raises(SystemExit, match="llama.cpp cannot come first"):
        compare.systems({}, None, "llama.cpp,none")
