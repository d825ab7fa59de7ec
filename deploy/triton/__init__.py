"""Serving on Triton Inference Server: model repository, launch, backend and client."""
