"""Data-parallel engine replicas on Ray Serve (``kvray serve --data-parallel-size N``): one
deployment of engine replicas, each with its worker group in its own placement group, routed
by the KV blocks each one holds, autoscaled by Serve; and one ingress deployment serving the
OpenAI HTTP API (through Serve's proxy) and the gRPC API over them."""
