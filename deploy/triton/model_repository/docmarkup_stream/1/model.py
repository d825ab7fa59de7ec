"""Triton entry point; the implementation is shared by both models: deploy/triton/backend.py."""

from deploy.triton.backend import TritonPythonModel

__all__ = ["TritonPythonModel"]
