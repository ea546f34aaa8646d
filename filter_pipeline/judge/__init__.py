"""The judges: the deterministic gate, and an LLM behind an OpenAI-compatible endpoint (`llm.py`), behind one
Dagster resource (`resource.py`)."""
