"""Tensor-parallel building blocks of the models. Every parameter carries a ``weight_loader``
that copies this rank's slice of a full checkpoint tensor into it."""
