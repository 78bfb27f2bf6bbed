"""Prometheus metrics of one engine (own registry, so several engines can live in one process)."""
from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5, 10, 30, 60)


class EngineMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self._children: dict = {}  # (metric, labels) -> its child (child())
        self.ttft = Histogram("lanner_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.tpot = Histogram("lanner_time_per_output_token_seconds", "Mean time per output token of a request",
                              registry=r, buckets=_LATENCY_BUCKETS)
        self.e2e = Histogram("lanner_request_latency_seconds", "End-to-end request latency", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.queue_len = Gauge("lanner_num_requests_waiting", "Requests waiting to be scheduled", registry=r)
        self.running = Gauge("lanner_num_requests_running", "Requests running", registry=r)
        self.kv_usage = Gauge("lanner_kv_cache_usage_ratio", "Fraction of the KV cache in use (paged: blocks; UlaCache: reserved entries)", registry=r)
        self.prefix_hit_rate = Gauge("lanner_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / "
                                     "prompt tokens admitted", registry=r)
        self.prompt_tokens = Counter("lanner_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.cached_tokens = Counter("lanner_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                                     registry=r)
        self.generation_tokens = Counter("lanner_generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter("lanner_requests_finished", "Finished requests", ["finish_reason"], registry=r)
        self.preemptions = Counter("lanner_preemptions", "Requests preempted for KV space", registry=r)
        self.step_errors = Counter("lanner_step_errors", "Engine steps that raised; their requests failed",
                                   registry=r)

        self.spec_verify_steps = Counter("lanner_spec_verify_steps", "Speculative verify steps", registry=r)
        self.spec_draft_tokens = Counter("lanner_spec_draft_tokens", "Draft tokens proposed", registry=r)
        self.spec_emitted_tokens = Counter("lanner_spec_emitted_tokens", "Tokens emitted by verify steps "
                                           "(accepted drafts + 1 each); / verify steps = acceptance length",
                                           registry=r)
        self.spec_accepted_at = Counter("lanner_spec_accepted_tokens", "Accepted draft tokens by chain position",
                                        ["position"], registry=r)
        # per proposer: hybrid speculation drafts each request's step from the suffix index or the head
        self.spec_proposer_steps = Counter("lanner_spec_proposer_verify_steps", "Verify steps by the proposer "
                                           "that drafted them", ["proposer"], registry=r)
        self.spec_proposer_draft_tokens = Counter("lanner_spec_proposer_draft_tokens", "Draft tokens proposed, by "
                                                  "proposer", ["proposer"], registry=r)
        self.spec_proposer_accepted_tokens = Counter("lanner_spec_proposer_accepted_tokens", "Draft tokens "
                                                     "accepted, by proposer", ["proposer"], registry=r)
        self.spec_propose_seconds = Counter("lanner_spec_propose_seconds", "Time spent drafting (all requests of a "
                                            "step together), by the engine's proposer", ["proposer"], registry=r)
        self.spec_propose_steps = Counter("lanner_spec_propose_steps", "Engine steps that drafted, by the "
                                          "engine's proposer", ["proposer"], registry=r)

        self.plugin_steps = Counter("lanner_plugin_steps", "Model calls by the plugin that ran them ('none': the "
                                    "engine's own forward) and step kind", ["plugin", "kind"], registry=r)
        self.plugin_failures = Counter("lanner_plugin_failures", "Plugin exceptions at run time (the step fell back "
                                       "and the plugin was disabled)", ["plugin", "kind"], registry=r)
        self.plugin_verified = Counter("lanner_plugin_verified_steps", "Steps checked against the engine's own "
                                       "forward (--plugin-verify)", ["plugin", "kind"], registry=r)
        self.plugin_verify_failures = Counter("lanner_plugin_verify_failures", "Verified steps that mismatched",
                                              ["plugin", "kind"], registry=r)
        self.plugin_build_bytes = Gauge("lanner_plugin_build_bytes", "Memory a plugin's build hook took off the KV "
                                        "budget", ["plugin"], registry=r)

    def child(self, metric, *labels: str):
        """metric.labels(*labels), looked up once per engine: prometheus_client's lookup costs a few us, and the
        per-step counters (plugin steps, speculation by proposer and position) take several a step."""
        key = (id(metric), labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def render(self) -> bytes:
        return generate_latest(self.registry)
