"""Where a deployed graph's boundary lies: which part of a captured contract becomes a graph, with
the one ATC shape strategy of each graph."""
