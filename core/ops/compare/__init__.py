"""Comparing checkpoints: :mod:`.diff` matches entries and streams block pairs; :mod:`.values`
holds the numbers of one pair; :mod:`.bitwise` says without torch that two checkpoints are the same
bit for bit, before any of that is needed (:mod:`dcpstudio.core.ops.verify` checks an output against its source
through the conversion's transform, with these)."""
