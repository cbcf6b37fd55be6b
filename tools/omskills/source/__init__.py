"""Reading the model's source: a static scan of its package (entries, control plane, CUDA-only
sites), the device-portability layer that runs CUDA-minded code elsewhere, logging every site."""
