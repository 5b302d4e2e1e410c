"""Checkpoint interchange with Hugging Face: to_maxtext (import) and, later, to_huggingface (export)."""
