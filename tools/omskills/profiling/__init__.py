"""Where the main path spends its time: the module profiler, and seed candidates read off a profile."""
