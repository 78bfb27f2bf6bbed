"""Lanner: a low-latency LLM inference engine."""
from lanner.engine.request import RequestOutput
from lanner.engine.sampling import SamplingParams
from lanner.llm import LLM

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
