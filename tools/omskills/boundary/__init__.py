"""Deployment boundaries: what of a captured contract becomes a graph, what stays in Python, and
the one ATC shape strategy of each graph."""
