"""The pure rules of the filter stage: parsing a batch, what is judged, the ledger walk, history, checks, reports.

Plain Python, pandas and pyarrow: nothing here imports Dagster, so each rule can be read and tested on its own.
"""
