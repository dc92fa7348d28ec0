"""Grammar-constrained sampling on rank 0: the tokenizer's vocabulary as xgrammar sees it
(``vocabulary``), one matcher per constrained request (``matchers``), and the token bitmask
applied to a step's logits (``bitmask``)."""
