"""The OpenAI Responses API and the Anthropic Messages API (issue 43) through the real official clients (openai,
openai-agents, anthropic), no mocks: one server for the module over the bundled model, behind an API key.
Tool calls use tool_choice required / any, which the grammar forces, so the 135M model makes them reliably."""
import json

import anthropic
import httpx
import openai
import pytest
from conftest import serve

from lanner.engine.async_engine import AsyncEngine
from lanner.server.app import build_app

KEY = "sk-test-43"
CALC_PARAMS = {"type": "object", "properties": {"expression": {"type": "string", "maxLength": 24}},
               "required": ["expression"], "additionalProperties": False}
CALC = {"type": "function", "name": "calculator", "description": "Evaluate an arithmetic expression such as 12 * 7",
        "parameters": CALC_PARAMS}
CALC_ANTHROPIC = {"name": "calculator", "description": "Evaluate an arithmetic expression such as 12 * 7",
                  "input_schema": CALC_PARAMS}
ASK = "What is 12 * 7?"


@pytest.fixture(scope="module")
def srv(llm32):
    engine = AsyncEngine(llm32.engine)
    with serve(build_app(engine, api_key=KEY)) as base:
        yield type("Srv", (), {
            "base": base, "model": engine.model_name, "engine": engine,
            "openai": openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=300),
            "anthropic": anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0, timeout=300)})
    engine.shutdown()


def test_messages_stream_starts_before_the_prefill_ends(srv):
    """A stream's headers and message_start go out once the engine has queued the request, not after its first
    token: an agent's long first prompt prefills for minutes on a CPU, and clients give up on a silent socket."""
    prompt = " ".join(f"item{i}" for i in range(1200))  # a few thousand tokens: several prefill steps
    with httpx.stream("POST", srv.base + "/v1/messages", timeout=300,
                      headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
                      json={"model": srv.model, "max_tokens": 4, "stream": True,
                            "messages": [{"role": "user", "content": prompt}]}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        start = json.loads(next(line for line in lines if line.startswith("data:"))[5:])
        req = srv.engine.engine.requests.get(start["message"]["id"])
        assert start["type"] == "message_start" and start["message"]["usage"]["input_tokens"] > 2000
        assert req is not None and not req.output_ids and req.num_computed < len(req.prompt_ids)
        rest = [json.loads(line[5:]) for line in lines if line.startswith("data:")]
    assert rest[-1]["type"] == "message_stop" and rest[-2]["usage"]["output_tokens"] == 4


# ---------------------------------------------------------------------------------------------- Responses
@pytest.mark.parametrize("tools", [False, True])
def test_responses_streamed_equals_non_streamed(srv, tools):
    kw = dict(model=srv.model, input=ASK, instructions="Answer briefly.", temperature=0, max_output_tokens=48)
    if tools:
        kw.update(tools=[CALC], tool_choice="required", parallel_tool_calls=False)
    whole = srv.openai.responses.create(**kw)
    events = list(srv.openai.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    done = events[-1].response
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert [o.model_dump(exclude={"id", "call_id"}) for o in done.output] == \
        [o.model_dump(exclude={"id", "call_id"}) for o in whole.output]
    assert done.usage.output_tokens == whole.usage.output_tokens
    assert whole.usage.input_tokens_details.cached_tokens >= 0
    if tools:
        call = whole.output[0]
        assert call.type == "function_call" and call.name == "calculator"
        assert "expression" in json.loads(call.arguments)
        assert {"response.function_call_arguments.delta", "response.function_call_arguments.done",
                "response.output_item.added", "response.output_item.done"} <= set(kinds)
        deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        assert deltas == call.arguments
    else:
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == whole.output_text == done.output_text and text


def test_responses_store_previous_response_id_and_function_call_output(srv):
    first = srv.openai.responses.create(model=srv.model, input=ASK, tools=[CALC], tool_choice="required",
                                        parallel_tool_calls=False, temperature=0, max_output_tokens=48)
    assert srv.openai.responses.retrieve(first.id).model_dump() == first.model_dump()
    call = first.output[0]
    # the follow-up sends only the tool's result; the call it answers comes from the stored history
    second = srv.openai.responses.create(
        model=srv.model, previous_response_id=first.id, temperature=0, max_output_tokens=16,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "84"}])
    assert second.previous_response_id == first.id and second.output_text
    with pytest.raises(openai.BadRequestError) as e:  # without the history the call_id answers nothing
        srv.openai.responses.create(model=srv.model, input=[{"type": "function_call_output",
                                                             "call_id": call.call_id, "output": "84"}])
    assert e.value.param == "input[0].call_id"
    with pytest.raises(openai.NotFoundError) as e:
        srv.openai.responses.create(model=srv.model, input="hi", previous_response_id="resp_nope")
    assert e.value.param == "previous_response_id"


def test_responses_json_schema_format(srv):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    r = srv.openai.responses.create(model=srv.model, input=ASK, temperature=0, max_output_tokens=24,
                                    text={"format": {"type": "json_schema", "name": "a", "schema": schema,
                                                     "strict": True}})
    assert isinstance(json.loads(r.output_text)["answer"], int)


def test_openai_agents_sdk_responses_model_runs_a_tool_loop(srv):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from agents.items import ToolCallItem, ToolCallOutputItem

    set_tracing_disabled(True)  # no network: the SDK would upload traces
    seen = []

    @function_tool
    def calc(expression: str) -> str:
        """Evaluate an arithmetic expression such as 12 * 7."""
        seen.append(expression)
        return "84"

    model = OpenAIResponsesModel(model=srv.model, openai_client=openai.AsyncOpenAI(
        base_url=srv.base + "/v1", api_key=KEY, max_retries=0, timeout=300))
    # required on the first turn; the SDK then resets tool_choice to auto, so the model can answer and stop
    agent = Agent(name="math", instructions="Use the calc tool for arithmetic.", tools=[calc], model=model,
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0,
                                               max_tokens=48))
    result = Runner.run_sync(agent, ASK, max_turns=4)
    calls = [i for i in result.new_items if isinstance(i, ToolCallItem)]
    outputs = [i for i in result.new_items if isinstance(i, ToolCallOutputItem)]
    assert calls and outputs and len(seen) == len(outputs)
    assert calls[0].raw_item.name == "calc" and "expression" in json.loads(calls[0].raw_item.arguments)
    assert isinstance(result.final_output, str) and result.final_output.strip()


# ---------------------------------------------------------------------------------------------- Messages
def test_anthropic_tool_round_trip_streamed_equals_non_streamed(srv):
    # the anthropic SDK 2.x dropped temperature from its signature; the server still takes it
    kw = dict(model=srv.model, max_tokens=48, extra_body={"temperature": 0}, tools=[CALC_ANTHROPIC],
              tool_choice={"type": "any", "disable_parallel_tool_use": True},
              system="Use the calculator.", messages=[{"role": "user", "content": ASK}])
    whole = srv.anthropic.messages.create(**kw)
    with srv.anthropic.messages.stream(**kw) as stream:
        kinds = [e.type for e in stream]
        streamed = stream.get_final_message()
    assert whole.stop_reason == streamed.stop_reason == "tool_use"
    use = whole.content[-1]
    assert use.type == "tool_use" and use.name == "calculator" and "expression" in use.input
    assert [b.model_dump(exclude={"id"}) for b in streamed.content] == \
        [b.model_dump(exclude={"id"}) for b in whole.content]
    assert {"message_start", "content_block_start", "content_block_stop", "message_delta", "message_stop"} <= \
        set(kinds)
    assert whole.usage.input_tokens > 0 and whole.usage.cache_read_input_tokens is not None

    history = kw["messages"] + [{"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                                   for b in whole.content]},
                                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                              "content": "84"}]}]
    kw2 = {**kw, "messages": history, "tool_choice": {"type": "auto"}, "max_tokens": 16}
    answer = srv.anthropic.messages.create(**kw2)
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content
    with srv.anthropic.messages.stream(**kw2) as stream:
        assert [b.model_dump(include={"type", "text"}) for b in stream.get_final_message().content] == \
            [b.model_dump(include={"type", "text"}) for b in answer.content]
    count = srv.anthropic.messages.count_tokens(model=srv.model, messages=history, tools=[CALC_ANTHROPIC],
                                                tool_choice={"type": "auto"}, system="Use the calculator.")
    # Anthropic's input_tokens leave out the cache reads: the second turn's history came from the prefix cache
    assert answer.usage.cache_read_input_tokens > 0
    assert count.input_tokens == answer.usage.input_tokens + answer.usage.cache_read_input_tokens


def test_anthropic_stop_sequence(srv):
    kw = dict(model=srv.model, max_tokens=12, extra_body={"temperature": 0},
              messages=[{"role": "user", "content": "Say hello."}])
    text = srv.anthropic.messages.create(**kw).content[0].text
    word = text.split()[min(2, len(text.split()) - 1)]
    r = srv.anthropic.messages.create(stop_sequences=[word], **kw)
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == word and word not in r.content[0].text


def test_auth_by_x_api_key_or_bearer(srv):
    body = {"model": srv.model, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    for headers in ({"x-api-key": KEY}, {"authorization": f"Bearer {KEY}"}):
        assert httpx.post(srv.base + "/v1/messages", json=body, headers=headers, timeout=60).status_code == 200
    r = httpx.post(srv.base + "/v1/messages", json=body, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=srv.base, auth_token="wrong", max_retries=0).messages.create(**body)


# ---------------------------------------------------------------------------------------------- bad input
USER = [{"role": "user", "content": "hi"}]
BAD_MESSAGES = [
    ({"messages": USER}, "max_tokens"),
    ({"max_tokens": 4, "messages": USER + [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}]},
     "messages[1].content[0].tool_use_id"),
    ({"max_tokens": 4, "messages": USER, "tools": [{"name": "f", "input_schema": {"type": "objekt"}}]},
     "tools[0].input_schema"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "picture"}]}]},
     "messages[0].content[0].type"),
    ({"max_tokens": 4, "messages": USER, "temperature": 1.5}, "temperature"),
]
BAD_RESPONSES = [
    ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "call_nope", "output": "x"}]}, "input[0].call_id"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": "objekt"}}]},
     "tools[0].parameters"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}, {"type": "input_image"}]}]},
     "input[0].content[1].type"),
]


def test_bad_input_is_400_in_each_apis_shape_naming_the_field(srv):
    auth = {"x-api-key": KEY, "authorization": f"Bearer {KEY}"}
    for body, field in BAD_MESSAGES:
        r = httpx.post(srv.base + "/v1/messages", json={"model": srv.model, **body}, headers=auth, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
        assert err["error"]["message"].startswith(field + ":"), (field, err)
    for body, field in BAD_RESPONSES:
        r = httpx.post(srv.base + "/v1/responses", json={"model": srv.model, **body}, headers=auth, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field, (field, r.json())
    r = httpx.post(srv.base + "/v1/responses", json={"input": "hi", "previous_response_id": "resp_x"}, headers=auth)
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    with pytest.raises(anthropic.BadRequestError):
        srv.anthropic.messages.create(model=srv.model, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}])
    # the server runs on
    assert srv.anthropic.messages.create(model=srv.model, max_tokens=2, messages=USER).usage.output_tokens >= 1


def test_langchain_chat_anthropic_binds_tools(srv):
    from langchain_anthropic import ChatAnthropic
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def calc(expression: str) -> str:
        """Evaluate an arithmetic expression such as 12 * 7."""
        return "84"

    llm = ChatAnthropic(model=srv.model, base_url=srv.base, api_key=KEY, temperature=0, max_tokens=48,
                        max_retries=0, timeout=300)
    history = [HumanMessage(ASK)]
    ai = llm.bind_tools([calc], tool_choice="any", parallel_tool_calls=False).invoke(history)
    assert len(ai.tool_calls) == 1 and ai.tool_calls[0]["name"] == "calc"
    call = ai.tool_calls[0]
    history += [ai, ToolMessage(calc.invoke(call["args"]), tool_call_id=call["id"])]
    final = llm.bind_tools([calc]).invoke(history)  # the tool_use and its tool_result render
    assert final.content and final.response_metadata["stop_reason"] in ("end_turn", "max_tokens")


def test_each_api_names_the_cache_session(srv, llm32):
    """The session fields of each API, and the header on any route, reach the prefix cache's sessions; the first
    given wins (header, prompt_cache_key, user, safety_identifier)."""
    hi = [{"role": "user", "content": "Hi"}]
    srv.openai.chat.completions.create(model=srv.model, messages=hi, max_tokens=2, user="u1",
                                       extra_body={"prompt_cache_key": "chat-key"})
    srv.openai.chat.completions.create(model=srv.model, messages=hi, max_tokens=2, user="u2",
                                       extra_headers={"X-Session-Id": "header-session"})
    srv.openai.responses.create(model=srv.model, input="Hi", max_output_tokens=2,
                                extra_body={"safety_identifier": "responses-safety"})
    srv.anthropic.messages.create(model=srv.model, max_tokens=2, messages=hi, metadata={"user_id": "anthropic-user"})
    names = set(llm32.engine.kv.block_manager.sessions)
    assert {"chat-key", "header-session", "responses-safety", "anthropic-user"} <= names
    assert not {"u1", "u2"} & names


# ---------------------------------------------------------------------------------------------- the agents' payloads
def test_codex_cli_request_shape(srv):
    """Codex CLI 0.169 (docs/agents.md): developer items with ids, hosted tools beside function ones (a
    `namespace` and `web_search`, not offered to the model), reasoning / include / prompt_cache_key, no
    max_output_tokens. Was a 400 on tools[4].type."""
    body = {"model": srv.model, "stream": True, "store": False, "tool_choice": "required",
            "parallel_tool_calls": False, "reasoning": {"summary": "auto"}, "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "s1", "client_metadata": {"x": "y"},
            "input": [{"type": "message", "id": "msg_1", "role": "developer",
                       "content": [{"type": "input_text", "text": "Use the calculator."}]},
                      {"type": "message", "id": "msg_2", "role": "user", "content": [{"type": "input_text", "text": ASK}]}],
            "tools": [{**CALC, "strict": False},
                      {"type": "namespace", "name": "multi_agent_v1", "description": "d", "tools": [CALC]},
                      {"type": "web_search", "external_web_access": True}]}
    with httpx.stream("POST", srv.base + "/v1/responses", json=body, timeout=300,
                      headers={"authorization": f"Bearer {KEY}", "session-id": "s1"}) as r:
        assert r.status_code == 200, r.read()
        done = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")][-1]
    assert done["type"] == "response.completed", done
    assert [(o["type"], o["name"]) for o in done["response"]["output"]] == [("function_call", "calculator")]
    assert [t["name"] for t in done["response"]["tools"]] == ["calculator"]


def test_claude_code_request_shape(srv):
    """Claude Code 2.1.328: a system-role message inside messages, cache_control, thinking / context_management /
    output_config, ?beta=true and max_tokens=32000 (past this context: cut to what fits). Was a 400 on
    messages[1].role, then on max_tokens."""
    cached = {"cache_control": {"type": "ephemeral"}}
    body = {"model": srv.model, "max_tokens": 32000, "stream": True, "thinking": {"type": "adaptive"},
            "context_management": {"edits": []}, "output_config": {"effort": "high"},
            "metadata": {"user_id": '{"session_id": "s1"}'},
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.328;"},
                       {"type": "text", "text": "Use the calculator.", **cached}],
            "tools": [{**CALC_ANTHROPIC, **cached}, {"name": "Later", "description": "d", "defer_loading": True,
                                                     "input_schema": {"type": "object", "properties": {}}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "messages": [{"role": "user", "content": [{"type": "text", "text": ASK, **cached}]},
                         {"role": "system", "content": [{"type": "text", "text": "# Environment\ncwd: /tmp"}]}]}
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219"}
    with httpx.stream("POST", srv.base + "/v1/messages?beta=true", json=body, headers=headers, timeout=300) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1]["type"] == "message_stop"
    assert [e["delta"]["stop_reason"] for e in events if e["type"] == "message_delta"] == ["tool_use"]
