"""Text-side postprocessing in the ingress: incremental detokenization and stop strings."""
