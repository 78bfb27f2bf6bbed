"""The OpenAI-compatible server. Its defaults live here, light to import for the command line."""

DEFAULT_MAX_BODY_BYTES = 16 << 20  # a 128k-token prompt is well under 1 MiB of text or 1 MiB of ids
DEFAULT_SHUTDOWN_GRACE_S = 30.0  # on SIGTERM, how long requests in flight may still run
