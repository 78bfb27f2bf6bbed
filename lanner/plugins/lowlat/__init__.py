"""lowlat: Lanner's reference kernel plugin (C++/AVX-512, CPU): the whole Llama-family forward in one call for
small batches. Registered as the entry point `lowlat = "lanner.plugins.lowlat:LowLatPlugin"`."""
from lanner.plugins.lowlat.plugin import LowLatPlugin

__all__ = ["LowLatPlugin"]
