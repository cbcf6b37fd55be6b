"""Export and ONNX mechanisms: the contract wrapper and exporters, custom translations, optimised
variants (onnxslim, auto_optimizer, each checked by running it) and composing a chain of graphs."""
