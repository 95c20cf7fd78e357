"""Draft training (``specd distill``), one module per concern:

- ``data``: training data (corpora, token windows, text sampled from the target, the target's own
  replies for reduced-vocabulary drafts);
- ``draft``: the draft model, its configuration and initial weights (copied from the target);
- ``loop``: the training loop, the distillation loss and the held-out measures;
- ``export``: saving a trained draft (HF checkpoint, or a reduced-vocabulary draft's files);
- ``distill`` and ``distill_reduced``: the two recipes (full vocabulary; reduced vocabulary with the
  target's embeddings by reference), each data -> draft -> loop -> export;
- ``cli``: ``specd distill``'s flags and entry point.
"""
