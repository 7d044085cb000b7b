"""Evaluation of generated media: the shapes world (vocabulary, renderer) and adherence scoring.

Nothing here imports ``omniloop.train``; the training data imports this package.
"""
