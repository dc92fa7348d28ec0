"""Structured outputs on the controller side: checking a request's JSON schema for what the
grammar engine cannot enforce (``schema_check``) and compiling each request's constraint to a
grammar the sampling rank applies (``compiler``)."""
