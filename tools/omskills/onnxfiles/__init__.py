"""ONNX files: saving and loading models of any size (weights beside the graph), weights kept in a
file of their own, and the summary of a graph that stages, backends and ATC checks read."""
