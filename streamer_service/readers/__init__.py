"""Readers: bulk reads of tensor bytes into buffers we allocated, behind one interface.

Owns :class:`~.base.Reader` (the protocol the load loop is typed against, with its own
:class:`~.base.ReadRange` and :class:`~.base.RangeResult`), the choice of a reader for a URI
(:func:`~.choice.reader_for`: the one place the ``RUNAI_STREAMER_FS_STRATEGY`` and "local means
buffered" rules live), and the two implementations: :mod:`.runai` (Run:ai Model Streamer's native
reader; the only code that imports Run:ai) and :mod:`.mapped` (local files through mappings and
the native copier of ``streamer_client``).

May import: the foundation modules (``settings``, ``sizing``, ``uri``) and ``streamer_client``.
Not ``storage`` (listing and small reads are not bulk reads) nor anything above.
"""
