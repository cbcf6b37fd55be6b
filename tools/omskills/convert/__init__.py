"""Turning a candidate into ONNX graphs ready for ATC: the contract wrapper with its exporters,
custom translations, optimised variants each checked by running it, a chain of graphs composed into
one."""
