"""The judges: the deterministic gate, and an LLM behind an OpenAI-compatible endpoint, behind one Dagster
resource (`resource.py`). The LLM judge's settings (`config.py`), what it is shown (`prompt.py`), how its
replies are read (`replies.py`), one task's votes (`client.py`) over HTTP (`transport.py`) within the rate
controller (`rate.py`), and a batch's verdicts, reused, saved and resumed (`driver.py`)."""
