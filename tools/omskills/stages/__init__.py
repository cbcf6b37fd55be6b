"""Stage logic: the modules that run an adaptation's steps on a task record's path (deploy/ also
takes one, to read a verified run). Each reads the record, runs one step through the mechanisms
below it, and writes the step's result back (resumable)."""
