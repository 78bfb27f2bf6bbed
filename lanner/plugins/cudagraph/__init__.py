"""cudagraph: Lanner's GPU low-latency plugin, the CUDA counterpart of lowlat: decode and verify steps of dense
Llama-family models compiled whole (torch.compile, fullgraph) over padded buckets and replayed as CUDA graphs.
Registered as the entry point `cudagraph = "lanner.plugins.cudagraph:CudaGraphPlugin"`."""
from lanner.plugins.cudagraph.plugin import CudaGraphPlugin

__all__ = ["CudaGraphPlugin"]
