"""The load loop both modes share: batches of a plan read into slots and delivered in plan order.

Owns :mod:`.ring` (reusable slots plus at most one oversized buffer: bounded memory) and
:mod:`.pipeline` (batches in flight through a :class:`~streamer_service.readers.base.Reader`,
delivered in plan order, versions checked before delivery). What a slot is stays with the
caller: private memory in-process (``embedded``), shared-memory segments in the daemon.

May import: ``checkpoint``, ``readers``, the foundation modules and ``streamer_client``.
"""
