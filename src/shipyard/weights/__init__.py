"""Weight shipping: lossless delta codec, snapshot-and-delta store layout, subscribers, relays.

See ``docs/weights.md``. Modules: :mod:`.codec` (delta/snapshot blobs), :mod:`.types` (manifest,
layout keys), :mod:`.publisher`, :mod:`.versions` (read, plan, verify), :mod:`.leases` (subscriber
records, garbage collection), :mod:`.subscriber`, :mod:`.relay`; :mod:`.snapshot` re-exports the
entry points most callers need.
"""
