"""Model definitions (Llama family), weight loaders and the architecture registry."""
