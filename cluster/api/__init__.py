"""The gRPC API (proto package ``kvray.v1``) and its generated modules."""
