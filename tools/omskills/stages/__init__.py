"""Stage logic: the only modules that take a task record's path. Each reads the record, runs one
step through the mechanisms below it, and writes the step's result back (resumable)."""
