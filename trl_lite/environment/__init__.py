"""Text environments in which a language model calls tools: ``TextEnvironment``, ``TextHistory``."""

from .base_environment import StringStoppingCriteria, TextEnvironment, TextHistory

__all__ = ["StringStoppingCriteria", "TextEnvironment", "TextHistory"]
