"""Example: a byte-level GPT trained on the Python standard library's source with flash3."""
