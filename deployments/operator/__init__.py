"""The operator API's state: downloads, models started at run time, live events, the
cluster's hardware and a graceful drain, all in one light Serve deployment (operator.py)."""
