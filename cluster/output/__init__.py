"""The engine's output stage: each step's new tokens turned into text (incremental
detokenization), the stops that text and those tokens make, and the text safe to stream."""
