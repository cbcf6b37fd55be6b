"""What running the main path costs: each module's time measured, the memory of a graph call
predicted from the graph, seed candidates read off a profile."""
