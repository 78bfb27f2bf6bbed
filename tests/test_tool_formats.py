"""Tool calls as models write them (lanner.tool_formats): each family's parser on literal model text, streamed
split at every position, the grammar each family gets (checked with a character vocabulary, no model), and the real
Qwen2.5-Coder-1.5B through the server under tool_choice auto."""
import importlib
import json

import openai
import pytest
from conftest import serve

from lanner.models.catalog import CATALOG
from lanner.structured import StructuredOutput
from lanner.tool_formats import ToolCallParser, family_of

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"], "additionalProperties": False}}}
READ = {"type": "function", "function": {
    "name": "read_file", "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                        "required": ["path"], "additionalProperties": False}}}
TOOLS = [WEATHER, READ]
PARIS = ("get_weather", {"city": "Paris"})
MAIN = ("read_file", {"path": "src/main.py"})

# (family, model text, content, calls): what each family's models write, and the generic forms every family takes
CASES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.", [PARIS]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
               '{"name": "read_file", "arguments": {"path": "src/main.py"}}\n</tool_call>', None, [PARIS, MAIN]),
    # Qwen2.5-Coder's habit: a pretty-printed ```json fence where its template asks for <tool_call>
    ("hermes", '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```', None,
     [PARIS]),
    ("hermes", 'Reading it.\n```json\n{"name": "read_file", "arguments": {"path": "src/main.py"}}\n```\nDone.',
     "Reading it.\n\nDone.", [MAIN]),
    ("hermes", '```\n[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
               '{"name": "read_file", "arguments": "{\\"path\\": \\"src/main.py\\"}"}]\n```', None, [PARIS, MAIN]),
    ("gemma", '{"name": "read_file", "arguments": {"path": "a\\"}]{[.py"}}', None,  # brackets in a string
     [("read_file", {"path": 'a"}]{[.py'})]),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
    ("llama3", '<|python_tag|>{"name": "read_file", "parameters": {"path": "src/main.py"}}', None, [MAIN]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "read_file", "arguments": {"path": "src/main.py"}}]', None, [PARIS, MAIN]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', None, [PARIS]),
    ("mistral", '[{"name": "read_file", "arguments": {"path": "src/main.py"}}]', None, [MAIN]),  # marker skipped
    ("gemma", 'Sure.\n{"name": "get_weather", "parameters": {"city": "Paris"}}', "Sure.", [PARIS]),
    ("gemma", '```json\n{"name": "read_file", "arguments": {"path": "src/main.py"}}\n```', None, [MAIN]),
    # not calls: JSON naming no declared tool, other fences, a broken call, another family's marker, code braces
    ("hermes", '```json\n{\n  "name": "install_package",\n  "arguments": {}\n}\n```',
     '```json\n{\n  "name": "install_package",\n  "arguments": {}\n}\n```', []),
    ("hermes", 'A person: {"name": "Bob", "age": 3}. Code: ```python\nd = {"a": [1]}\n```',
     'A person: {"name": "Bob", "age": 3}. Code: ```python\nd = {"a": [1]}\n```', []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>', []),
    ("hermes", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', []),
    # cut by max_tokens mid-call: plain text
    ("hermes", '```json\n{\n  "name": "get_weather",\n  "arguments": {"ci',
     '```json\n{\n  "name": "get_weather",\n  "arguments": {"ci', []),
]


def parsed(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("family,text,content,calls", CASES)
def test_each_family_parses_whole_and_streamed_split_anywhere(family, text, content, calls):
    got, found = ToolCallParser(TOOLS, family).feed(text, final=True)
    assert (got or None, parsed(found)) == (content, calls)
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in found)
    for size in (1, 2, 3, 7):  # every chunk boundary, mid-tag and mid-name included
        parser, streamed, stream_calls = ToolCallParser(TOOLS, family), "", []
        for i in range(0, len(text), size):
            delta, new = parser.feed(text[i:i + size])
            streamed, stream_calls = streamed + delta, stream_calls + new
        delta, new = parser.feed("", final=True)
        assert (streamed + delta or None, parsed(stream_calls + new)) == (content, calls), size


def test_held_back_text_is_released_when_it_is_no_call():
    parser = ToolCallParser(TOOLS)
    assert parser.feed('Here: {"na') == ("Here:", [])  # could still be {"name": "get_weather" ...
    assert parser.feed('me": "Bob"}, ```js') == (' {"name": "Bob"},', [])  # an undeclared name: content
    assert parser.feed("on\n{") == ("", [])  # a ```json fence opening an object: held
    assert parser.feed("}\n```") == (" ```json\n{}", [])  # not on "name": released; a fence may follow
    assert parser.feed("", final=True) == ("\n```", [])


def test_parallel_false_keeps_the_first_call_and_ends_the_turn():
    text = CASES[1][1] + "\nMore text."
    parser = ToolCallParser(TOOLS, parallel=False)
    content, calls = parser.feed(text[:90])
    assert parsed(calls) == [PARIS] and content == ""
    assert parser.feed(text[90:], final=True) == ("", [])


def test_family_from_the_template():
    from lanner.tool_calls import TOOL_CHAT_TEMPLATE

    assert family_of(TOOL_CHAT_TEMPLATE) == "hermes"
    assert family_of("... [TOOL_CALLS] ...") == "mistral"
    assert family_of("{{ '<|python_tag|>' }} ipython") == "llama3"
    assert family_of("<start_of_turn>user") == "gemma" and family_of(None, "gemma3") == "gemma"
    assert family_of(None) == "hermes"
    with pytest.raises(ValueError, match="family"):
        StructuredOutput(tools=TOOLS, family="nope")


# ---------------------------------------------------------------------------------------------- grammars
@pytest.fixture(scope="module")
def accepts():
    """Whether a constraint's grammar accepts a text, on a one-character-per-token vocabulary."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo([chr(i) for i in range(32, 127)] + ["\n"])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def run(so: StructuredOutput, text: str) -> bool:
        return xgr.GrammarMatcher(compiler.compile_structural_tag(so.structural_tag())).accept_string(text)
    return run


QWEN_CALL = '```json\n{\n  "name": "read_file",\n  "arguments": {\n    "path": "src/main.py"\n  }\n}\n```'


@pytest.mark.parametrize("text,ok", [
    ("Free text, {\"a\": 1} and {\"name\": \"Bob\"} and ```python\nx = 1\n```", True),  # no trigger: free
    (QWEN_CALL, True),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', True),
    ('Sure: {"name": "get_weather", "parameters": {"city": "Oslo"}} ok', True),
    ('```json\n{\n  "name": "install_package"', False),  # a fence on "name": the name must be declared
    ('{"name": "get_weather", "arguments": {"town": "Oslo"', False),  # armed: the schema holds
    ('{\n    "name": "read_file",\n    "arguments": {"path": 3', False),
])
def test_auto_arms_at_the_first_trigger(accepts, text, ok):
    assert accepts(StructuredOutput(tools=TOOLS), text) is ok


def test_required_named_and_one_call(accepts):
    hermes = StructuredOutput(tools=TOOLS, tool_choice="required")
    assert accepts(hermes, '<tool_call>\n{"name": "read_file", "arguments": {"path": "a"}}\n</tool_call>')
    assert not accepts(hermes, "Sure")  # a call from the first token
    llama = StructuredOutput(tools=TOOLS, tool_choice="function:get_weather", family="llama3")
    assert accepts(llama, '{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert not accepts(llama, '{"name": "read_file"')
    one = StructuredOutput(tools=TOOLS, parallel_tool_calls=False)
    assert accepts(one, QWEN_CALL) and not accepts(one, QWEN_CALL + "\n")  # the call ends the turn


# ---------------------------------------------------------------------------------------------- the real model
HAVE_QWEN = importlib.util.find_spec(CATALOG["qwen2.5-coder-1.5b"].module(1)) is not None


@pytest.fixture(scope="module")
def qwen():
    from lanner.config import EngineConfig
    from lanner.engine.async_engine import AsyncEngine
    from lanner.engine.llm_engine import LLMEngine
    from lanner.server.app import build_app

    engine = AsyncEngine(LLMEngine(EngineConfig(model="qwen2.5-coder-1.5b", max_model_len=2048)))
    try:
        with serve(build_app(engine)) as base:
            yield openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=900), engine
    finally:
        engine.shutdown()


@pytest.mark.skipif(not HAVE_QWEN, reason="needs the Qwen2.5-Coder-1.5B parts (make model-qwen)")
def test_qwen_coder_calls_under_auto_streamed_and_not(qwen):
    """Qwen2.5-Coder writes ```json fences where its template asks for <tool_call>: under tool_choice auto they
    come back as tool_calls, streamed the same, with finish_reason tool_calls."""
    client, engine = qwen
    kw = dict(model=engine.model_name, messages=[{"role": "user", "content": "Show me what is in src/main.py"}],
              tools=TOOLS, temperature=0, max_tokens=64)
    full = client.chat.completions.create(**kw).choices[0]
    assert full.finish_reason == "tool_calls" and full.message.content is None, full.message
    (call,) = full.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == MAIN
    calls, reason = {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            assert not c.delta.content
            reason = c.finish_reason or reason
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": d.function.name, "arguments": ""})
                entry["arguments"] += d.function.arguments or ""
    assert reason == "tool_calls" and [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(call.function.name, call.function.arguments)]
