"""The child process that parses a large DCP ``.metadata`` and hands back only its index (the
parent side is :func:`.children.build_in_child`).

Unpickling a ``.metadata`` that lists 100,000 tensors makes millions of Python objects: ~1.4 GB at
its peak, and seconds in C code that holds the GIL (the C unpickler; freeing the objects) -- a
window's GUI thread stutters meanwhile however the work is sliced. In a child process none of that
touches the caller: the child runs the same restricted parse and checks
(:func:`.metadata.index_from_bytes`) on the very bytes the parent read, handed over as its
stdin (it never opens the checkpoint: the folder may have changed since), and writes the index in
its pickle-free serialised form to its stdout; the parent reads it back as it reads the index
cache, and checks that it lists the entries it opened. A refusal in the child (an unsafe pickle,
damaged metadata) is raised again in the parent with the same class and message; a child that
dies or hangs is reported as such.

    python -m dcpstudio.core.checkpoints.dcp.index_child LABEL < .metadata   # index bytes on stdout
"""

from __future__ import annotations

import json
import os
import sys

from ... import errors
from ...formats.dcp.files import METADATA_FILE, METADATA_LIMIT
from . import metadata as dcp_metadata


def main(argv: list[str]) -> int:
    dcp_metadata.IN_CHILD = True  # parse here, store nothing: the parent checks and caches
    label = argv[0] if argv else METADATA_FILE  # how the parent names the file, in messages
    data = sys.stdin.buffer.read(METADATA_LIMIT + 1)
    try:
        if len(data) > METADATA_LIMIT:
            raise errors.UnsupportedFormatError(f"{label}: larger than DCP Studio reads")
        index = dcp_metadata.index_from_bytes(data, label)
    except (errors.CorruptCheckpointError, errors.UnsafePickleError, errors.UnsupportedFormatError) as e:
        found = {"error": type(e).__name__, "message": str(e)}
        if isinstance(e, errors.UnsafePickleError):
            found.update(source=e.source, what=e.what)
        print(json.dumps(found), file=sys.stderr)
        return 3
    sys.stdout.buffer.write(index.to_bytes())
    sys.stdout.flush()
    os._exit(0)  # no teardown: freeing millions of records one by one would only cost time


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
