"""Recipes built on the library: ``grpo`` is the training job behind ``sharedprefix train``."""
