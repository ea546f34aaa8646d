"""The `filter-pipeline` command line."""
