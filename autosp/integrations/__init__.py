"""Integrations with training frameworks, each imported on its own (``import autosp`` imports none):
``autosp.integrations.transformers`` (Hugging Face ``Trainer`` and TRL's trainers)."""
