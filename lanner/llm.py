"""vLLM-style offline API: `LLM(...).generate(prompts, params)` and `.chat(conversations, params)`."""
from __future__ import annotations

import dataclasses

from tqdm import tqdm

from lanner.config import EngineConfig
from lanner.engine.request import RequestOutput
from lanner.engine.sampling import SamplingParams
from lanner.engine.llm_engine import LLMEngine
from lanner.tool_calls import parse_tool_calls, prepare_chat


class LLM:
    """engine_options: EngineConfig fields, e.g. tp=2 (tensor parallelism: worker processes are started here and
    stopped by close(), at the end of a `with` block, or at interpreter exit)."""

    def __init__(self, model: str | None = None, dtype: str = "auto", device: str | None = None,
                 **engine_options):
        self.engine = LLMEngine(EngineConfig(model=model, dtype=dtype, device=device, **engine_options))
        self.tokenizer = self.engine.tokenizer

    def close(self):
        self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """prompts: a string, a token-id list, or a list of either. Returns one output per prompt, in order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run([self.engine.make_request(p, self._params(params, i)) for i, p in enumerate(prompts)],
                         use_tqdm)

    def chat(self, conversations, params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False, tools: list[dict] | None = None, tool_choice: str | dict | None = None,
             parallel_tool_calls: bool | None = None, response_format: dict | None = None) -> list[RequestOutput]:
        """conversations: one list of OpenAI-style messages, or a list of such lists. tools, tool_choice,
        parallel_tool_calls and response_format mean what they mean in the OpenAI chat API (lanner.tool_calls);
        with tools, each output's tool_calls holds the calls parsed from its text."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        reqs = []
        for i, conv in enumerate(conversations):
            prompt_ids, structured = prepare_chat(self.tokenizer, conv, tools, tool_choice, parallel_tool_calls,
                                                  response_format)
            params_i = self._params(params, i)
            if structured is not None:
                params_i = dataclasses.replace(params_i, structured=structured)
            reqs.append(self.engine.make_request(None, params_i, prompt_ids=prompt_ids))
        outputs = self._run(reqs, use_tqdm)
        if tools and tool_choice != "none":
            for out, req in zip(outputs, reqs):
                out.tool_calls = parse_tool_calls(out.text, req.params.structured, tools)[1]
        return outputs

    @staticmethod
    def _params(params, i):
        if isinstance(params, list):
            return params[i]
        return params or SamplingParams()

    def _run(self, reqs, use_tqdm) -> list[RequestOutput]:
        # requests beyond the queue limit wait here rather than being refused: offline use has no client to retry
        pending = list(reqs)
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(reqs), desc="generate", disable=not use_tqdm)
        while pending or self.engine.has_unfinished():
            while pending and self.engine.has_room():
                self.engine.enqueue(pending.pop(0))
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [final[r.request_id] for r in reqs]
