"""Retrieval over uploaded files: their text, its chunks, their vectors and the search."""
