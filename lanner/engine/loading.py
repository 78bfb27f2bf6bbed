"""Loading what every tensor-parallel rank loads alike: plugins chosen and checked, the target's shard, the plugins
built; and the KV block count the budget leaves."""
from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from lanner.config import EngineConfig
from lanner.distributed import agree_min
from lanner.models.loader import ModelSource, load_config, load_model
from lanner.plugins import Hardware, PluginRuntime, select_plugins, storage_ptrs, tensor_bytes

log = logging.getLogger("lanner")


class LoadedTarget(NamedTuple):
    model: torch.nn.Module
    model_config: object  # lanner.models.config.ModelConfig
    plugins: PluginRuntime | None
    plugin_bytes: int  # bytes the plugins hold (taken off the KV budget)
    weights: str  # "stored" | "dequantize": how the GGUF blocks were loaded


def load_target(config: EngineConfig, hardware: Hardware, metrics=None):
    """What every tensor-parallel rank does alike: choose and check plugins (before any weight loads, so a
    mismatch costs nothing), load this rank's shard, build the plugins. -> (model, ModelConfig, PluginRuntime or
    None, bytes the plugins hold, the weights mode it loaded)."""
    source = ModelSource.resolve(config.model)
    loaded_config = load_config(source)
    # UlaCache's decoders run the model's own forward: no plugin covers them ("auto" then picks none)
    choice = config.plugin if config.kv_tier is None else None
    plugins = select_plugins(choice, loaded_config[0], hardware, config.plugin_options)
    weights = config.weights
    if config.weights_auto and weights == "stored" and not any(p.name == "lowlat" for p in plugins):
        weights = "dequantize"  # e.g. an architecture lowlat does not cover: the own forward runs it all
    model, model_config = load_model(source, config.torch_dtype, hardware.device, loaded_config, weights)
    plugin_bytes = build_plugins(plugins, model, model_config, hardware, metrics)
    runtime = PluginRuntime(plugins, metrics, config.plugin_verify) if plugins else None
    return LoadedTarget(model, model_config, runtime, plugin_bytes, weights)


def build_plugins(plugins, model, model_config, hardware: Hardware, metrics=None) -> int:
    """Runs each plugin's build hook; returns the bytes they now hold (taken off the KV budget)."""
    total, cuda = 0, hardware.kind == "cuda"
    owned = storage_ptrs(model)
    for p in plugins:
        before = torch.cuda.memory_allocated(hardware.device) if cuda else 0
        p.build(model, model_config, hardware)
        used = torch.cuda.memory_allocated(hardware.device) - before if cuda else tensor_bytes(p, owned)
        if metrics is not None:
            metrics.plugin_build_bytes.labels(p.name).set(used)
        log.info("plugin %s built: %.1f MiB", p.name, used / 2**20)
        total += max(0, used)
    return total


def kv_blocks(config: EngineConfig, per_token: int, plugin_bytes: int) -> int:
    """KV blocks of this rank's budget; under TP the smallest over the ranks, since every rank keeps the same
    block count (rank 0 hands out the block tables)."""
    kv_bytes = config.kv_cache_bytes(per_token, already_used=plugin_bytes)
    return agree_min(kv_bytes // (per_token * config.block_size))
