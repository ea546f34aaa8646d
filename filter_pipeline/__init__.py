"""filter_pipeline: the filter stage as a Dagster code location (`definitions.py` wires it).

Importing the package first tunes Arrow's allocator for the process (`settings.tune_allocators`): every process
that loads the code location (the CLI, `dagster dev`'s code server, a run worker, a run pod) imports this before
pandas or pyarrow.
"""

from filter_pipeline.settings import tune_allocators

tune_allocators()
