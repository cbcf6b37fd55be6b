"""The adaptation's steps, each run on a task record's path: read the record, run one step through
the mechanisms below, write its result back (resumable)."""
