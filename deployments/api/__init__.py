"""The HTTP dialects, one folder each, whole: its request schemas, its routes and their
helpers. A dialect imports no other; what two share lives here, below them all
(structured outputs and tools, slots, prompt objects, warm contexts, operator calls)."""
