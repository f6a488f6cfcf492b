"""The decoding layer: drafting, tree building over the pruner, verification, acceptance and
the generation loop. Above ``models`` and ``ngram``; below ``dart_model``, ``train`` and
``apps``."""
