"""The `kt-sglang` command."""
