"""Kernel plugins: discovery through entry points, selection and checks, and per-step dispatch with counters,
verification against the engine's own forward, and fallback. The contract is in lanner.plugins.base."""
from __future__ import annotations

import logging
from importlib.metadata import entry_points

import torch

from lanner.distributed import any_rank, tp_size
from lanner.plugins.base import (  # noqa: F401
    Hardware,
    Plugin,
    PluginCollectiveAbort,
    PluginMismatch,
    PluginVerifyError,
    Step,
    StepKind,
    plugin_all_reduce,
)

log = logging.getLogger("lanner")
GROUP = "lanner.plugins"
# PluginRuntime._guarded's results for a plugin that does not cover the step, and for a call that failed
_SKIPPED, _FAILED = object(), object()
# plugins registered in code (tests, notebooks), selectable like installed ones; tensor-parallel workers get
# a copy (the classes travel by import path)
_REGISTERED: dict[str, type] = {}


def register_plugin(name: str, cls: type):
    if not (isinstance(cls, type) and issubclass(cls, Plugin)):
        raise TypeError(f"register_plugin({name!r}): {cls!r} is not a lanner.plugins.Plugin class")
    _REGISTERED[name] = cls


def registered_plugins() -> dict[str, type]:
    return dict(_REGISTERED)


def discover() -> dict:
    """name -> entry point of every installed plugin (group `lanner.plugins`)."""
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def load_plugin(name: str, options: dict | None = None) -> Plugin:
    if name in _REGISTERED:
        plugin = _REGISTERED[name](**(options or {}))
        plugin.name = plugin.name or name
        return plugin
    eps = discover()
    if name not in eps:
        raise PluginMismatch(f"plugin {name!r} is not installed; installed plugins: {', '.join(sorted(eps)) or 'none'}"
                             f" (plugins register under the entry-point group {GROUP!r})")
    cls = eps[name].load()
    if not (isinstance(cls, type) and issubclass(cls, Plugin)):
        raise PluginMismatch(f"plugin {name!r}: entry point {eps[name].value} is not a lanner.plugins.Plugin class")
    plugin = cls(**(options or {}))
    plugin.name = plugin.name or name
    return plugin


def select_plugins(choice: str | None, model_config, hardware: Hardware, options: dict | None = None) -> list[Plugin]:
    """choice: None/"none" -> []; "auto" -> every installed plugin (entry point) that supports the model, passes
    check and does not ask to be named (Plugin.auto); others are skipped with a log line; plugins registered in code
    are used only when named: auto is the default, and a test's or notebook's plugin must not slip into every
    engine; "a,b" -> exactly these, and any that does not fit raises PluginMismatch. options: {plugin name: {option:
    value}}."""
    if choice in (None, "", "none"):
        return []
    options = options or {}
    auto = choice == "auto"
    names = sorted(discover()) if auto else [n.strip() for n in choice.split(",") if n.strip()]
    unknown = set(options) - set(names)
    if unknown and not auto:
        raise PluginMismatch(f"plugin options given for {sorted(unknown)}, which are not selected")
    chosen = []
    for name in names:
        try:
            plugin = load_plugin(name, options.get(name))
            if auto and not plugin.auto:
                log.info("plugins auto: skipping %s: it runs only when named (--plugin %s)", name, name)
                continue
            if not plugin.supports(model_config):
                raise PluginMismatch(f"plugin {name!r} does not support the model structure "
                                     f"{model_config.architecture}; it supports "
                                     f"{list(plugin.architectures) or 'a predicate'}")
            plugin.check(model_config, hardware)
        except PluginMismatch as e:
            if not auto:
                raise
            log.info("plugins auto: skipping %s: %s", name, e)
            continue
        except Exception as e:  # a broken plugin must not take auto mode down with it
            if not auto:
                raise PluginMismatch(f"plugin {name!r} failed to load: {type(e).__name__}: {e}") from e
            log.warning("plugins auto: skipping %s: %s: %s", name, type(e).__name__, e)
            continue
        chosen.append(plugin)
    return chosen


def tensor_bytes(obj, exclude: set | None = None) -> int:
    """Bytes of the distinct tensor storages reachable from obj's attributes (modules, lists, dicts), leaving
    out storages in `exclude` (data_ptrs of storages the engine already owns, e.g. the model's weights)."""
    seen, total, stack, visited = set(exclude or ()), 0, [obj], set()
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            st = o.untyped_storage()
            if st.data_ptr() not in seen and o.device.type != "meta":
                seen.add(st.data_ptr())
                total += st.nbytes()
            continue
        if id(o) in visited or isinstance(o, (str, bytes, int, float, bool, type(None), type)):
            continue
        visited.add(id(o))
        if isinstance(o, torch.nn.Module):
            stack.extend(o.parameters())
            stack.extend(o.buffers())
        if isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        elif hasattr(o, "__dict__"):
            stack.extend(vars(o).values())
    return total


def storage_ptrs(module: torch.nn.Module) -> set:
    return {t.untyped_storage().data_ptr() for t in list(module.parameters()) + list(module.buffers())}


class PluginRuntime:
    """Routes each model call to the first plugin that covers it, else to the module's own forward.

    verify_steps: for the first N calls of each (plugin, step kind) also run the own forward and raise
    PluginVerifyError beyond tolerance. A plugin that raises during a step is disabled, the step reruns on
    the own forward, and the failure is logged and counted: no request is lost. Under tensor parallelism the
    ranks agree after each plugin call (one small all-reduce) whether it failed anywhere, so they all fall back
    together and their collectives stay in line."""

    def __init__(self, plugins: list[Plugin], metrics=None, verify_steps: int = 0):
        self.plugins = list(plugins)
        self.disabled: dict[str, str] = {}  # name -> why
        self.metrics, self.verify_steps = metrics, verify_steps
        self.verified: dict[tuple[str, str], int] = {}
        self.counts: dict[tuple[str, str], int] = {}  # (plugin or "none", kind) -> calls, also in /metrics
        self.last: Plugin | None = None  # the plugin that ran the latest forward, for its logits

    @property
    def active(self) -> list[Plugin]:
        return [p for p in self.plugins if p.name not in self.disabled]

    def _count(self, name: str, kind: str):
        key = (name, kind)
        self.counts[key] = self.counts.get(key, 0) + 1
        if self.metrics is not None:
            self.metrics.child(self.metrics.plugin_steps, name, kind).inc()

    def forward(self, step: Step, module, *args):
        kind = step.kind.value
        self.last = None
        for plugin in self.active:  # call and verify use this iteration's plugin: _guarded runs them at once
            def call():
                if not plugin.covers(step) or (step.tree and not plugin.tree_verify):
                    return _SKIPPED
                return plugin.forward(step, module, *args)

            def verify(out):
                self._verify(plugin, step, out, module(*args))

            out = self._guarded(plugin, kind, call, verify)
            if out is _FAILED:
                break
            if out is not _SKIPPED:
                self.last = plugin
                return out
        self._count("none", kind)
        return module(*args)

    def compute_logits(self, step: Step, model, hidden):
        """Logits of `hidden` rows by the plugin that ran this step's forward, when it has a logits head."""
        plugin = self.last
        if plugin is None or plugin.compute_logits is None or plugin.name in self.disabled:
            return model.compute_logits(hidden)
        out = self._guarded(plugin, "logits", lambda: plugin.compute_logits(step, model, hidden),
                            lambda out: self._verify(plugin, step, out, model.compute_logits(hidden), "logits"))
        return model.compute_logits(hidden) if out is _FAILED else out

    def compute_argmax(self, step: Step, model, hidden):
        """compute_logits(...).argmax(-1) for a greedy step: the plugin's fused compute_argmax when it has one
        (checked against its own logits' argmax for the first --plugin-verify steps, exactly)."""
        plugin = self.last
        fused = None if plugin is None or plugin.name in self.disabled else plugin.compute_argmax
        if fused is None:
            return self.compute_logits(step, model, hidden).argmax(-1)

        def verify(out):
            want = self.compute_logits(step, model, hidden).argmax(-1)
            if not torch.equal(out, want):
                raise PluginVerifyError(f"plugin {plugin.name} (argmax, {step.num_tokens} tokens): "
                                        f"{out.tolist()} differs from its logits' argmax {want.tolist()}")

        out = self._guarded(plugin, "argmax", lambda: fused(step, model, hidden), verify)
        return model.compute_logits(hidden).argmax(-1) if out is _FAILED else out

    def draft_chain(self, step: Step, head, *args, method: str = "draft_chain"):
        """A draft head's whole greedy chain in one plugin call (no Python between draft steps), from the first
        active plugin that covers the step and has a `draft_chain(head, *args)` method; None when none does (or
        it declines, or it failed: then it is disabled), and the caller runs the chain step by step.
        method="draft_propose": the draft-extend before the chain in the same call (`draft_propose(head, *args)`)."""
        for plugin in self.active:
            chain = getattr(plugin, method, None)
            if chain is None:
                continue

            def call():
                return chain(head, *args) if plugin.covers(step) else _SKIPPED

            out = self._guarded(plugin, method, call, declines=True)
            if out is not _SKIPPED:
                return None if out is _FAILED else out
        return None

    def _guarded(self, plugin: Plugin, kind: str, call, verify=None, declines: bool = False):
        """call() made for `plugin` in a `kind` call: its result, counted, or _FAILED when it raised here or (under
        TP) on another rank, which disables the plugin. _SKIPPED from call() (the plugin does not cover the step)
        and, where the plugin `declines` with None, None, pass through uncounted. For the first verify_steps
        results of (plugin, kind), verify(result) runs (it raises on a mismatch) before the count."""
        try:
            out, error = call(), None
        except Exception as e:
            out, error = None, e
        if out is _SKIPPED:
            return out
        if self._failed_anywhere(plugin, kind, error):
            return _FAILED
        if declines and out is None:
            return None
        key = (plugin.name, kind)
        if verify is not None and self.verified.get(key, 0) < self.verify_steps:
            self.verified[key] = self.verified.get(key, 0) + 1
            verify(out)
        self._count(plugin.name, kind)
        return out

    def _failed_anywhere(self, plugin: Plugin, kind: str, error: Exception | None) -> bool:
        """Disables the plugin if its call failed on this rank or (under TP) on any other; True if so."""
        if tp_size() > 1 and not plugin.consistent_failures and any_rank(error is not None) and error is None:
            error = PluginCollectiveAbort("the plugin failed on another tensor-parallel rank")
        if error is None:
            return False
        self.disabled[plugin.name] = f"{type(error).__name__}: {error}"
        log.error("plugin %s failed in a %s step; disabled, falling back to the engine's own forward", plugin.name,
                  kind, exc_info=error)
        if self.metrics is not None:
            self.metrics.plugin_failures.labels(plugin.name, kind).inc()
        return True

    def _verify(self, plugin: Plugin, step: Step, got, want, what: str | None = None):
        what = what or step.kind.value
        tol = plugin.verify_tolerance
        got_t, want_t = _tensors(got), _tensors(want)
        if len(got_t) != len(want_t):
            raise PluginVerifyError(f"plugin {plugin.name} ({what}): returned {len(got_t)} tensors, "
                                    f"the engine's forward {len(want_t)}")
        for i, (g, w) in enumerate(zip(got_t, want_t)):
            if tol is None:
                tol = 1e-4 if w.dtype == torch.float32 else 3e-2
            if g.shape != w.shape:
                raise PluginVerifyError(f"plugin {plugin.name} ({what}): output {i} has shape "
                                        f"{tuple(g.shape)}, expected {tuple(w.shape)}")
            err = ((g.float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-6)).item() \
                if w.numel() else 0.0
            if not err <= tol:
                if self.metrics is not None:
                    self.metrics.plugin_verify_failures.labels(plugin.name, what).inc()
                raise PluginVerifyError(f"plugin {plugin.name} ({what}, {step.num_tokens} tokens, batch "
                                        f"{step.batch_size}): output {i} differs from the engine's forward by "
                                        f"{err:.3g} (relative max), tolerance {tol:g}")
        if self.metrics is not None:
            self.metrics.plugin_verified.labels(plugin.name, what).inc()


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    return []
