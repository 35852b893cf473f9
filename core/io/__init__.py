"""Moving bytes: opening the files a checkpoint names (:mod:`.files`), reading them into tensor
memory without copies (:mod:`.raw`), atomic outputs (:mod:`.atomic`), tensors cut into bounded
boxes (:mod:`.blocks`), recycled buffers (:mod:`.buffers`),
writes past the page cache (:mod:`.direct`), look-ahead (:mod:`.pipeline`), the
cache of derived indexes (:mod:`.index_cache`), and -- at the bottom -- where bytes live
(:mod:`.remote`).

Nothing here knows a checkpoint format. It imports :mod:`..dtypes`, :mod:`..units` and
:mod:`..errors` only."""
