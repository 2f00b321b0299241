"""OpenAI's Vector Stores API: stores, their files and file batches, and search, over the
app's database and the vector index (deployments/retrieval)."""
