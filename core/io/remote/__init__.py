"""Where checkpoints live when not on local disk: object storage and HTTP through fsspec, the
byte-range layer under every reader.

:mod:`.locations` (local paths and URLs as one kind of location), :mod:`.files` (remote objects as
seekable files, uploads as writers), :mod:`.stream` (bounded range reads), :mod:`.calls`
(deadlines, retries, minimum rates) and :mod:`.fs` (URLs, one-line errors, counters). It imports
only :mod:`dcpstudio.core.errors` and :mod:`dcpstudio.core.units`."""
