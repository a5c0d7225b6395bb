"""The OpenAI-compatible HTTP gateway of a backbone."""
