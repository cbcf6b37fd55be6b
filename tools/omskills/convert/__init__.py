"""Export and ONNX mechanisms: the contract wrapper and exporters, custom translations, optimised
variants (onnxslim, auto_optimizer), inspection and saving of models of any size."""
