"""The bottom layer: typed config sections and their help, the project's errors, file helpers, tensor ops."""
