"""The node cache of a checkpoint's metadata: config, tokenizer and code files, pulled once per
node into a directory engines read as a local model.

Owns :mod:`.cache` (:class:`~.cache.MetadataCache`: pull, the completion marker, the listing it
records) and :mod:`.lock` (the inter-process lock that keeps two processes from pulling the same
checkpoint at once).

May import: ``storage``, the foundation modules (``settings``, ``uri``, ``access``) and
``streamer_client``. Needs no torch.
"""
