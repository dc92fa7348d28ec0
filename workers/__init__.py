"""What runs inside one kvray worker actor: a tensor-parallel shard of the model, its slice of
the KV cache, and the runner that executes one step plan. Importable and testable without Ray."""
