"""Antidistillation: the proxy-gradient sampler (``ads``) and the pipeline's work directory (``pipeline``)."""
