"""The embedded default model: a small qwen2moe trained on the King James Bible (see training/)."""

from pathlib import Path

EMBEDDED_MODEL = Path(__file__).parent / "data" / "embedded.gguf"
DEFAULT_PROMPT = "And the LORD said unto Moses,"
