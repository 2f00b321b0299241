"""The Serve application: the graph's deployments (ingress, tokenizer, model server,
embedder, registry, router) and how they are built and configured here; the HTTP
request path in http/; each API dialect in api/<dialect>/; the one database in state/;
the operator's control plane in operator/ and its page in ui/."""
