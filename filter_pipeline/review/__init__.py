"""The review app's reading side and its web app: every run's fate table, a task's whole story, the labelling
queue (`data.py`, `story.py`, `queue.py`: pure reads over the data root, local or s3://), and the Starlette
app serving them (`app.py`, with its templates and static files)."""
