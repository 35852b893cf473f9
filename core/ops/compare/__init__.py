"""Comparing checkpoints: :mod:`.diff` matches entries and streams block pairs; :mod:`.values`
holds the numbers of one pair (:mod:`dcpstudio.core.ops.verify` checks an output against its source
through the conversion's transform, with these)."""
