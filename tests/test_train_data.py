"""Draft-head training data (ShareGPT split, target responses, eval sets) and `lanner eval-accept`."""
import json
from pathlib import Path

import pytest
import torch

from lanner import SamplingParams
from lanner.cli import main
from lanner.spec.draft_head import random_draft_head
from lanner.train.data import (
    _json_list_prefix,
    code_prompts,
    humaneval_rows,
    generate_responses,
    load_eval_set,
    load_prompts_file,
    load_training_data,
    original_responses,
    sharegpt_prompts,
    split_sharegpt,
)
from lanner.train.eval_accept import short_labels


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # the CPU is shared with other work: two torch threads fighting it for two cores run 10x slower than one
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_sharegpt_split_is_deterministic_and_disjoint():
    all_ids = [p["id"] for p in sharegpt_prompts()]
    assert len(all_ids) == len(set(all_ids)) > 5000
    train, held = split_sharegpt(seed=0)
    assert (train, held) == split_sharegpt(seed=0)
    assert split_sharegpt(seed=1)[1] != held
    assert len(train) == round(0.9 * len(all_ids)) and len(train) + len(held) == len(all_ids)
    assert not {p["id"] for p in train} & {p["id"] for p in held}
    assert all(len(p["turns"]) == 1 and 0 < len(p["turns"][0]) <= 2000 for p in train + held)
    assert load_eval_set("sharegpt", limit=5) == held[:5]


def test_original_responses_are_sharegpt_replies_in_the_chat_template(default_gguf):
    from lanner.models.loader import ModelSource
    from lanner.tokenizer import Tokenizer

    tok = Tokenizer(ModelSource.resolve(default_gguf), [2])
    train, _ = split_sharegpt(seed=0)
    prompts = train[:20] + [{"id": "no-such-id", "turns": ["hello"]}]
    rows = original_responses(tok, prompts, eos_id=2)
    assert 10 <= len(rows) <= 20 and "no-such-id" not in {r["id"] for r in rows}
    row = rows[0]
    first = next(p for p in prompts if p["id"] == row["id"])
    assert row["prompt_ids"] == tok.apply_chat_template([{"role": "user", "content": first["turns"][0]}])
    assert row["output_ids"][-1] == 2 and len(row["output_ids"]) > 5
    assert tok.decode(row["output_ids"][:-1]).strip()  # the reply text, not the prompt
    assert tok.decode(row["output_ids"][:-1]) not in tok.decode(row["prompt_ids"])


def test_truncated_json_list_keeps_complete_records():
    assert _json_list_prefix('[\n {"a": 1},\n {"a": [2, 3]},\n {"a": "cut off') == [{"a": 1}, {"a": [2, 3]}]
    assert _json_list_prefix('[{"a": 1}, {"a": 2}]') == [{"a": 1}, {"a": 2}]


def test_eval_set_sizes():
    humaneval, mtbench, gsm8k = load_eval_set("humaneval"), load_eval_set("mtbench"), load_eval_set("gsm8k")
    assert (len(humaneval), len(mtbench), len(gsm8k)) == (164, 80, 1319)
    assert all(len(item["turns"]) == 2 for item in mtbench)
    assert humaneval[0]["turns"][0].startswith("Complete the following Python function:\n```python\n")
    assert humaneval[0]["turns"][0].endswith("```")
    assert load_eval_set("gsm8k", limit=3) == gsm8k[:3]
    assert len({item["id"] for item in gsm8k}) == 1319
    with pytest.raises(ValueError, match="unknown eval set"):
        load_eval_set("nope")


def test_code_prompts_are_humaneval_shaped_tasks_from_source_files():
    import ast

    items = code_prompts(30)
    assert len(items) == 30 and len({i["id"] for i in items}) == 30 and code_prompts(30) == items
    he = load_eval_set("humaneval", limit=1)[0]["turns"][0]
    head, tail = he[: he.index("```python\n") + 10], "```"
    entry_points = {r["entry_point"] for r in humaneval_rows()}
    for item in items:
        text = item["turns"][0]
        assert text.startswith(head) and text.endswith(tail) and item["id"].startswith("code/")
        # a signature and its docstring, the body left to write: exactly what HumanEval asks
        fn = ast.parse(text[len(head) : -len(tail)]).body[-1]
        assert isinstance(fn, ast.FunctionDef) and fn.name not in entry_points
        assert len(fn.body) == 1 and len(ast.get_docstring(fn)) >= 40


def test_prompts_file_errors_name_the_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"turns": ["hi", "and then?"]}\n\n{"id": "x", "turns": ["ok"]}\n')
    assert load_prompts_file(str(path)) == [{"id": "line1", "turns": ["hi", "and then?"]},
                                            {"id": "x", "turns": ["ok"]}]
    for bad in ('{"turns": "not a list"}', '{"turns": ["fine"]', '["no", "dict"]', '{"turns": []}'):
        path.write_text('{"turns": ["fine"]}\n' + bad + "\n")
        with pytest.raises(ValueError, match=r"p\.jsonl:2: "):
            load_prompts_file(str(path))


def test_generate_responses_resumes_and_matches_generate(llm32, tmp_path):
    prompts = [{"id": f"p{i}", "turns": [t]} for i, t in enumerate(["Hi!", "Name a color.", "What is 2+2?",
                                                                    "Say yes."])]
    out_dir = str(tmp_path / "responses")
    path = generate_responses(llm32, prompts[:3], out_dir, max_new_tokens=8, batch_size=2)
    first = Path(path).read_text()
    assert [r["id"] for r in load_training_data(path)] == ["p0", "p1", "p2"]

    generate_responses(llm32, prompts, out_dir, max_new_tokens=8, batch_size=2)
    text = Path(path).read_text()
    assert text.startswith(first)  # old rows untouched, only the new prompt appended
    rows = load_training_data(path)
    assert [r["id"] for r in rows] == ["p0", "p1", "p2", "p3"]

    for row, p in zip(rows, prompts):
        ids = llm32.tokenizer.apply_chat_template([{"role": "user", "content": p["turns"][0]}])
        assert row["prompt_ids"] == ids
        out = llm32.generate(ids, SamplingParams(temperature=0, max_tokens=8))[0]
        assert row["output_ids"] == out.token_ids and 0 < len(row["output_ids"]) <= 8
    meta = json.loads(Path(out_dir, "meta.json").read_text())
    assert {"split_seed", "train_frac", "model", "max_new_tokens", "temperature", "num_prompts"} <= meta.keys()
    assert meta["num_prompts"] == 4
    with pytest.raises(ValueError, match="max_new_tokens"):  # other settings must not mix into the same file
        generate_responses(llm32, prompts, out_dir, max_new_tokens=16)


def test_eval_accept_cli(llm32, tmp_path):
    head = tmp_path / "head"
    random_draft_head(llm32.engine.model_config, draft_vocab_size=2048, seed=1).save(str(head))
    out = tmp_path / "ea.json"
    assert main(["eval-accept", "--draft", f"{head},hass", "--datasets", "gsm8k", "--limit", "2", "--steps", "1,2",
                 "--max-new-tokens", "8", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(r["draft"], r["dataset"], r["steps"]) for r in result["rows"]] == [
        (str(head), "gsm8k", 1), (str(head), "gsm8k", 2), ("hass", "gsm8k", 1), ("hass", "gsm8k", 2)]
    # one plain run serves both drafts
    assert len({(r["dataset"], r["plain_tok_s"]) for r in result["rows"]}) == 1
    for row in result["rows"]:
        assert {"draft", "dataset", "steps", "tau", "tok_s", "plain_tok_s", "identical", "prompts"} <= row.keys()
        assert row["identical"] is True and row["tau"] >= 1 and row["prompts"] == 2
    png = tmp_path / "ea.png"
    assert png.stat().st_size > 0
    png.unlink()
    assert main(["eval-accept", "--json", str(out), "--replot"]) == 0  # the chart again, from the JSON alone
    assert png.stat().st_size > 0 and json.loads(out.read_text()) == result
    # heads of several runs share a folder name: the legend tells them apart by their parents
    assert short_labels(["runs/a/head", "runs/b/head", "hass"]) == ["a/head", "b/head", "hass"]
