"""The model families kvray serves: each family's model file and config parser, and the one
table naming them by Hugging Face architecture (``workers.models.registry``)."""
