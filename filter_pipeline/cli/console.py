"""The console of the CLI's runs: Dagster's lines on stderr, one line per event (the run's event log keeps the
whole of each)."""

import logging
import sys

import dagster as dg


class _WithoutTraces(logging.Formatter):
    """Dagster's console line, without the error and stack trace Dagster appends to a failure event after
    a blank line (the CLI prints the failure in one line; the run's event log keeps the whole trace)."""

    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).split("\n\n", 1)[0]


@dg.logger(
    config_schema={
        "log_level": dg.Field(str, is_required=False, default_value="INFO", description="The logger's threshold."),
        "name": dg.Field(str, is_required=False, default_value="dagster", description="The logger's name."),
    },
    description="The CLI's console: Dagster's lines on stderr, one line per event (no stack traces).",
)
def one_line_console(init_context) -> logging.Logger:
    log = logging.Logger(init_context.logger_config["name"], level=init_context.logger_config["log_level"].upper())
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_WithoutTraces("%(asctime)s - %(name)s - %(levelname)s - %(message)s"))
    log.addHandler(handler)
    return log
