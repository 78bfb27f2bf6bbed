"""Shared output of the benchmarks: the run's environment, a JSON file, a markdown table and a PNG chart."""
from __future__ import annotations

import json
import os
import platform
import time
import warnings

BENCH_EXTRA = "pip install 'lanner[bench]'"


def output_paths(json_path: str | None, out_dir: str, name: str) -> tuple[str, str]:
    """(json, png): --json wins over --out-dir; the chart always sits next to the JSON with the same stem."""
    json_path = json_path or os.path.join(out_dir, f"{name}.json")
    return json_path, os.path.splitext(json_path)[0] + ".png"


def environment(engine_config) -> dict:
    import torch

    return {
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": engine_config.device,
        "dtype": engine_config.dtype,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "gpu": torch.cuda.get_device_name() if engine_config.device.startswith("cuda") else None,
    }


def write_json(path: str, data: dict):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def fmt(value, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def charts_missing() -> str | None:
    """Why no chart can be drawn, or None: matplotlib is the `bench` extra, not a core dependency."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return f"matplotlib is not installed; the charts need it: {BENCH_EXTRA}"
    return None


def charts_or_warning(output: str) -> bool:
    """Whether charts can be drawn; if not, warns now that `output` will not be written."""
    missing = charts_missing()
    if missing:
        warnings.warn(f"{missing}; {output} will not be written", stacklevel=2)
    return missing is None


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (benchmarks run headless); ImportError naming the extra if
    matplotlib is missing."""
    missing = charts_missing()
    if missing:
        raise ImportError(missing)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def bar_chart(path: str, labels: list[str], values: list[float], title: str, ylabel: str):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    bars = ax.bar(labels, values, color=["#3b6ea8", "#e0873a", "#5a9e5a", "#9467bd"][: len(values)])
    ax.bar_label(bars, fmt="%.1f")
    ax.margins(y=0.12)  # room for the value labels
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def line_chart(path: str, x: list, series: dict[str, list[float]], title: str, xlabel: str, ylabel: str):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, ys in series.items():
        ax.plot(x, ys, marker="o", label=name)
    ax.set_xscale("log", base=2)  # concurrency levels are usually powers of two
    ax.set_xticks(x, [str(v) for v in x])
    ax.minorticks_off()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
