"""The kvray service: controller actor, scheduler, gRPC server, Python client and CLI."""
