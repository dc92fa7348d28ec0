"""``kvray bench``: throughput, serving latency and prefix caching, with the engine's own KV
memory waste and step overhead, and a decode step's cost by context length, printed as a table
and optionally written as JSON. The checkpoints they compare come from ``cluster.fixtures``
(``kvray make-checkpoint``)."""
