"""The judge's messages (at the current prompt version) for generated tasks, shared by the judge benchmarks."""

from filter_pipeline.judge.config import LLMJudgeConfig
from filter_pipeline.judge.prompt import Evidence, build_messages, success_criteria


def task_messages(i: int, steps: list, final_url: str, page_text: str) -> list[dict]:
    """The messages the judge would be shown for generated task `i` (an add-to-cart task on one shop)."""
    criteria = success_criteria("add_to_cart", "shop.example", f'["shop.example","#add",{i}]', "url")
    evidence = Evidence(steps=steps, final_url=final_url, page_text=page_text, agent_output=None, screenshots=(),
                        evidence="trajectory")  # fmt: skip
    return build_messages(f"Add item {i} to the cart", criteria, evidence, LLMJudgeConfig())
