"""One module per API dialect, each with a module-level `router` (see
deployments.ingress_app.dialects): OpenAI, Ollama, llama.cpp, Parrot."""
