"""Collectives between tensor-parallel ranks that torch.distributed's backends serve slowly."""
