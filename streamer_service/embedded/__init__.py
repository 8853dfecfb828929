"""In-process mode: a load in the calling process, no daemon, no shared memory.

Owns :mod:`.backend` (what ``streamer_client`` finds through its entry point group
``streamer_client.backends``: ``stream`` and ``pull``, imported cheaply), :mod:`.stream` (a
request checked and streamed), :mod:`.engine` (plan, buffers, reads and delivery of one load),
:mod:`.slots` (the engine's ring slots) and :mod:`.buffers` (private host buffers and the
process's pool of page-locked ones).

May import: ``load``, ``checkpoint``, ``readers``, ``metadata``, ``storage``, the foundation
modules and ``streamer_client``. Not ``daemon``: the two modes share only what lies below them.
"""
