"""rlflow: GRPO reinforcement learning for LLMs on PyTorch Lightning, extended through entry-point plugins."""

__version__ = "0.1.0"
