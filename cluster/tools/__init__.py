"""Tool calling: the grammars that force a call (``forced``), the parsers that find the calls a
model wrote in its own format (``parsers``), and the two turned into OpenAI's ``tool_calls``,
whole or as stream deltas (``output``)."""
