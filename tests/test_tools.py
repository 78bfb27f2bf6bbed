"""Tools and structured output through the real server and real clients (official openai, openai-agents,
LangChain), the bundled model under xgrammar constraints. One server for the module; the validity checks batch
their requests so the engine decodes them together."""
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from conftest import openai_server

from lanner.structured import Grammars, unpack_bitmask
from lanner.tool_calls import prepare_chat, structured_output

CALC = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression such as 12 * 7",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string", "maxLength": 24}},
                   "required": ["expression"], "additionalProperties": False}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "city": {"type": "string", "maxLength": 16}},
          "required": ["name", "age", "city"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What is 12 * 7?"}]


@pytest.fixture(scope="module")
def srv():
    with openai_server(max_num_seqs=64) as (base, engine, client):
        yield type("Srv", (), {"base": base, "engine": engine, "client": client, "model": engine.model_name})


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression such as 12 * 7."""
    allowed = set("0123456789+-*/(). ")
    return str(eval(expression, {}, {})) if expression and set(expression) <= allowed else "error"  # noqa: S307


# ---------------------------------------------------------------------------------------------- agent loops
def test_openai_agents_sdk_runs_a_tool_loop(srv):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from agents.items import ToolCallItem, ToolCallOutputItem

    set_tracing_disabled(True)  # no network: the SDK would upload traces
    seen = []

    @function_tool
    def calc(expression: str) -> str:
        """Evaluate an arithmetic expression such as 12 * 7."""
        seen.append(expression)
        return calculator(expression)

    model = OpenAIChatCompletionsModel(model=srv.model, openai_client=openai.AsyncOpenAI(
        base_url=srv.base + "/v1", api_key="unused", max_retries=0, timeout=900))
    # required on the first turn; the SDK then resets tool_choice to auto, so the model can answer and stop
    agent = Agent(name="math", instructions="Use the calc tool for arithmetic.", tools=[calc], model=model,
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0,
                                               max_tokens=48))
    result = Runner.run_sync(agent, "What is 12 * 7?", max_turns=4)
    calls = [i for i in result.new_items if isinstance(i, ToolCallItem)]
    outputs = [i for i in result.new_items if isinstance(i, ToolCallOutputItem)]
    assert calls and outputs and len(seen) == len(outputs)
    assert calls[0].raw_item.name == "calc" and "expression" in json.loads(calls[0].raw_item.arguments)
    assert isinstance(result.final_output, str) and result.final_output.strip()


def test_langchain_bind_tools_round_trip(srv):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def calc(expression: str) -> str:
        """Evaluate an arithmetic expression such as 12 * 7."""
        return calculator(expression)

    llm = ChatOpenAI(model=srv.model, base_url=srv.base + "/v1", api_key="unused", temperature=0, max_tokens=48,
                     max_retries=0, timeout=900)
    history = [HumanMessage("What is 12 * 7? Use the calculator.")]
    ai = llm.bind_tools([calc], tool_choice="required", parallel_tool_calls=False).invoke(history)
    assert len(ai.tool_calls) == 1 and ai.tool_calls[0]["name"] == "calc"
    call = ai.tool_calls[0]
    history += [ai, ToolMessage(calc.invoke(call["args"]), tool_call_id=call["id"])]
    final = llm.bind_tools([calc]).invoke(history)  # the history with the call and its result renders
    assert isinstance(final.content, str) and final.content.strip() and not final.tool_calls


def test_openai_client_history_round_trip(srv):
    """An assistant turn with tool_calls and the tool's answer go back in; the model's answer uses it."""
    r = srv.client.chat.completions.create(model=srv.model, messages=ASK, tools=[CALC], tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=48)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "calculator"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, CALC["function"]["parameters"])
    history = ASK + [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "84"}]
    final = srv.client.chat.completions.create(model=srv.model, messages=history, tools=[CALC], temperature=0,
                                               max_tokens=32)
    assert final.choices[0].message.content
    # the prompt the server built holds the call and its result, in the Hermes layout
    tok = srv.engine.engine.tokenizer
    prompt_ids, _ = prepare_chat(tok, history, [CALC])
    assert final.usage.prompt_tokens == len(prompt_ids)
    text = tok.decode(prompt_ids, skip_special_tokens=False)
    assert f'<tool_call>\n{{"name": "calculator", "arguments": {call.function.arguments}}}\n</tool_call>' in text
    assert text.endswith("<|im_start|>user\n<tool_response>\n84\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n")


# ---------------------------------------------------------------------------------------------- validity
def test_fifty_required_calls_and_fifty_schemas_all_validate(srv):
    cities = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Delhi", "Rome", "Quito", "Accra", "Hanoi"]
    calls = [dict(messages=[{"role": "user", "content": f"What is the weather in {cities[i % 10]}? "
                                                        f"Or compute {i} + {i * 3}."}],
                  tools=[CALC, WEATHER], tool_choice="required", parallel_tool_calls=False)
             for i in range(50)]
    people = [dict(messages=[{"role": "user", "content": f"Invent person number {i} living in {cities[i % 10]}, "
                                                         "as JSON with name, age and city."}],
                   response_format={"type": "json_schema",
                                    "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
              for i in range(50)]

    def ask(kw):
        return srv.client.chat.completions.create(model=srv.model, temperature=0.7, seed=1, max_tokens=96, **kw)

    with ThreadPoolExecutor(100) as pool:
        results = list(pool.map(ask, calls + people))
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (CALC, WEATHER)}
    for r in results[:50]:
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
        (call,) = r.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    for r in results[50:]:
        assert r.choices[0].finish_reason == "stop", r.choices[0].message
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_json_object_and_auto(srv):
    r = srv.client.chat.completions.create(model=srv.model, messages=[{"role": "user", "content": "Describe a cat"}],
                                           response_format={"type": "json_object"}, temperature=0, max_tokens=96)
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)
    # auto: free text is allowed, and whatever calls appear are complete and valid
    r = srv.client.chat.completions.create(model=srv.model, messages=[{"role": "user", "content": "Say hello"}],
                                           tools=[CALC], temperature=0, max_tokens=32)
    m = r.choices[0].message
    assert m.content and "<tool_call>" not in m.content
    for call in m.tool_calls or []:
        jsonschema.validate(json.loads(call.function.arguments), CALC["function"]["parameters"])


def test_streaming_gives_the_same_calls(srv):
    kw = dict(model=srv.model, messages=[{"role": "user", "content": "Weather in Oslo and Lima?"}],
              tools=[CALC, WEATHER], tool_choice="required", temperature=0, max_tokens=96)
    full = srv.client.chat.completions.create(**kw).choices[0]
    calls, content, reason = {}, "", None
    for chunk in srv.client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            reason = c.finish_reason or reason
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
                entry["arguments"] += d.function.arguments or ""
    assert reason == full.finish_reason
    assert (content or None) == full.message.content
    want = [(c.function.name, c.function.arguments) for c in full.message.tool_calls]
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == want and want
    assert all(calls[i]["id"].startswith("call_") for i in calls)


def test_forced_drafts_are_lossless(srv):
    """Greedy float32 output is the same with grammar-forced drafts on and off, and forced drafts raise tau."""
    kw = dict(model=srv.model, messages=ASK, tools=[CALC, WEATHER], tool_choice="required", temperature=0,
              max_tokens=64)
    config = srv.engine.engine.config
    # a user each: the suffix proposer's shared index must not let one run draft from the other's output
    on = srv.client.chat.completions.create(**kw, user="forced-drafts-on")
    config.grammar_draft_tokens = 0  # read at each step; the server is idle between these requests
    try:
        off = srv.client.chat.completions.create(**kw, user="forced-drafts-off")
    finally:
        config.grammar_draft_tokens = 8
    assert [c.function for c in on.choices[0].message.tool_calls] == \
        [c.function for c in off.choices[0].message.tool_calls]
    assert on.usage.completion_tokens == off.usage.completion_tokens
    assert on.usage.spec_accept_length > (off.usage.spec_accept_length or 1)


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema"),
    ({"tools": [CALC], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
     "tools[0].function.parameters"),
    ({"messages": ASK + [{"role": "tool", "tool_call_id": "call_x", "content": "84"}]}, "messages[1].tool_call_id"),
])
def test_bad_input_is_a_400_naming_the_field(srv, body, param):
    r = httpx.post(srv.base + "/v1/chat/completions", timeout=60,
                   json={"model": srv.model, "messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    ok = srv.client.chat.completions.create(model=srv.model, messages=ASK, max_tokens=4)  # others run on
    assert ok.choices[0].finish_reason == "length"


# ---------------------------------------------------------------------------------------------- grammar unit
def test_grammar_forces_cuts_and_caches(srv):
    """Forced tokens of a named tool are its call prefix; a draft is cut at the first token the grammar rejects;
    each verify row's mask allows the forced token; equal constraints compile once."""
    engine = srv.engine.engine
    tok = engine.tokenizer
    grammars = Grammars(tok.hf, engine.model_config.vocab_size, engine.eos_token_ids)
    named = {"type": "function", "function": {"name": "get_weather"}}
    state = grammars.state(structured_output([CALC, WEATHER], named), 16)
    grammars.state(structured_output([CALC, WEATHER], named), 16)
    assert (grammars.misses, grammars.hits) == (1, 1)
    forced = state.forced_tokens(16)
    assert tok.decode(forced).startswith('<tool_call>\n{"name": "get_weather", "arguments')
    good = tok.hf.encode('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"', add_special_tokens=False)
    bad = tok.hf.encode('<tool_call>\n{"name": "calculator"', add_special_tokens=False)
    n, masks = state.check_draft(good)
    assert n == len(good) and masks.shape[0] == n + 1
    bits = unpack_bitmask(masks, engine.model_config.vocab_size)
    assert all(bits[i, t] for i, t in enumerate(good))
    assert bits[0].sum() < 10  # after nothing, only ways to start "<tool_call>" are legal
    cut = next(i for i, (a, b) in enumerate(zip(good, bad)) if a != b)
    assert state.check_draft(bad)[0] == cut
    assert state.forced_tokens(16) == forced  # check_draft left the matcher where it was
