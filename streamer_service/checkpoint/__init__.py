"""A checkpoint as the loaders see it: headers, the tensor table, the plan, object versions.

Owns :mod:`.header` (safetensors headers, read and validated), :mod:`.catalog` (the tensor table
of a checkpoint's shards and index), :mod:`.plan` (the one ordering rule: selections, batches,
the union of ranks' selections; pure), :mod:`.versions` (the bytes of a load come from the
versions its headers were read from), :mod:`.open` (a checkpoint opened for streaming: metadata
pulled, catalog cached) and :mod:`.tensor_table` (the catalog as text, for ``inspect``).

May import: ``metadata``, ``storage``, the foundation modules and ``streamer_client``. Not the
readers: nothing here reads tensor bytes.
"""
