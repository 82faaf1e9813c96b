"""What the user describes: the job spec, presets, model sources and the GPU catalog."""
