"""What the judge's tests share: verdict texts, a client config for a test server, a prompt, a responder."""

from filter_pipeline.judge.config import LLMJudgeConfig
from filter_pipeline_tests.openai_server import Reply

PASS = '{"passed": true, "why": "done"}'
FAIL = '{"passed": false, "why": "wrong item"}'
PROSE = "I believe the agent did it."


def settings(server, **kw) -> LLMJudgeConfig:
    defaults = dict(base_url=server.base_url, model="judge-test", backoff_initial_seconds=0.01,
                    backoff_max_seconds=0.05, task_budget_seconds=5.0)  # fmt: skip
    return LLMJudgeConfig(**{**defaults, **kw})


def prompt(name: str) -> list[dict]:
    return [{"role": "system", "content": "judge"}, {"role": "user", "content": f"task {name}"}]


def sequence(*replies: Reply):
    """A responder answering the calls in turn, the last reply from then on."""
    return lambda call, n: replies[min(n, len(replies) - 1)]
