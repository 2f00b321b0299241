"""Ray Serve deployments: thin adapters around the engine, tokenizer and embedder."""
