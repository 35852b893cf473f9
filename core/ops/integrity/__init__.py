"""Trusting one checkpoint on its own: :mod:`.check` (is it whole: every file, record, frame and
chunk table as the readers would take it, and with ``values`` its NaN, Inf and all-zero tensors,
counted by :mod:`.counts` with bit tests, no torch) and :mod:`.digests` (content digests over a
tensor's canonical bytes, the same in every format).

It uses :mod:`..explore` (streaming statistics) and the checkpoints below; nothing in
:mod:`..convert` or :mod:`..compare` depends on it."""

from __future__ import annotations

from .check import CheckReport, Finding, check, check_path
from .digests import ALGORITHM, Digest, digests, tensor_digest, value_digest

__all__ = ["ALGORITHM", "CheckReport", "Digest", "Finding", "check", "check_path", "digests", "tensor_digest",
           "value_digest"]  # fmt: skip
