"""The command line, ``dcpstudio``: argument parsing, one function per command, the exit codes.

A command parses its flags, calls the same :mod:`dcpstudio.core` function the window calls, and prints
its result; a domain error (:class:`~dcpstudio.core.errors.DCPStudioError`) becomes one line on stderr
and exit 1, a usage error exit 2. It imports core, never the window (``dcpstudio open`` starts the
window through :mod:`dcpstudio.window.main`, imported when asked)."""
