"""LangChain integration for specagent: ``ChatSpecAgent``."""

from .chat_models import POLICY_METADATA_KEY, ChatSpecAgent

__all__ = ["POLICY_METADATA_KEY", "ChatSpecAgent"]
