"""lowlat: Lanner's reference kernel plugin (C++, CPU: AVX-512, or AVX2 on 256-bit halves): the whole
Llama-family forward in one call for small batches. Registered as the entry point
`lowlat = "lanner.plugins.lowlat:LowLatPlugin"`."""
from lanner.plugins.lowlat.plugin import LowLatPlugin, cpu_variant

__all__ = ["LowLatPlugin", "cpu_variant"]
