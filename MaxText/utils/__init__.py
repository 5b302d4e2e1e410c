"""Command-line utilities beside the trainer (MaxText's maxtext.utils layout)."""
