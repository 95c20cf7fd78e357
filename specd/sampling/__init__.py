"""Sampling and verification: pure functions below both the engine and the proposers.

Vocabulary (one decode step of one request):

- **root**: node 0 of a :class:`~specd.sampling.tree.DraftTree`, the request's pending token.
- **draft tokens**: every other node, proposed by a proposer (draft model, feature head, prompt
  lookup, suffix store, grammar-forced tokens).
- **accepted tokens**: the draft tokens verification keeps; always a root-to-node path.
- **correction (recovered) token**: what the target emits where the walk stops at a node whose
  children were all rejected.
- **bonus token**: what the target emits after the accepted path when it ends at a leaf.

Modules: ``params`` (SamplingParams, the one validation of sampling fields), ``probs`` (logits ->
probabilities, seeded per-request draws), ``tree`` (the draft tree verification walks), ``verify``
(greedy and lossless tree rejection sampling). Nothing here imports ``specd.engine`` or
``specd.speculation``; both import this package.
"""
