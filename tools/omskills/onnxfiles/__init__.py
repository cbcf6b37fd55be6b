"""ONNX files of any size read or written: weights beside the graph, weights in a file of their own,
a graph's summary read without its weights."""
