"""The `filter-pipeline` command line."""

# Exit statuses, the same for every command: 1 something was not done (a run failed, a task not found, the
# endpoint refused, the audit found something), 2 an argument, setting or input is wrong (one line on stderr,
# nothing done), 3 some attempts were left unjudged (asked again by the next call).
EXIT_FAILED, EXIT_BAD_INPUT, EXIT_UNJUDGED = 1, 2, 3
