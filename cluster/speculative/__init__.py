"""Speculative decoding on the controller: what ``--speculative-config`` asks for, and the
proposers that draft tokens for the scheduler to send with a request's next step (the workers
verify them in that step's forward; ``workers.runner``)."""
