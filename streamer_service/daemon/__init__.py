"""The node daemon: one read of each byte per node, served to many ranks through shared memory.

Owns the HTTP service (:mod:`.server`: sockets and uvicorn, with :mod:`.stop_signals`; :mod:`.api`:
the routes of the wire protocol, ``streamer_client._protocol``), the daemon's state (:mod:`.core`:
sessions by key, the memory budget, the reaper; :mod:`.readiness`), a session and its ranks
(:mod:`.session`, :mod:`.ledger`, :mod:`.session_buffers`), shared memory (:mod:`.shm`,
:mod:`.pages`) and the bytes kept for later loads (:mod:`.resident`), rank processes
(:mod:`.process`) and what the daemon reports (:mod:`.stats`, :mod:`.metrics`, :mod:`.scrape`: the
metrics listener).

May import: ``load``, ``checkpoint``, ``readers``, ``metadata``, ``storage``, the foundation
modules and ``streamer_client``. Not ``embedded``, and never torch (a test blocks it).
"""
