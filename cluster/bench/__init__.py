"""``kvray bench``: throughput, serving latency and prefix caching, with the engine's own KV
memory waste and step overhead, printed as a table and optionally written as JSON."""
