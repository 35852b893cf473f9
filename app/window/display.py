"""Can the window open here? One actionable line when it cannot, before Qt aborts the process.

Qt prints a multi-line message and calls ``abort()`` when its platform plugin cannot start: no
display, or (Linux, X11) a system library the xcb plugin links against is missing. Both are
checked first, without loading the plugin: the libraries the plugin needs are listed by the
dynamic loader (``ldd``), and the missing ones are named with the Debian/Ubuntu packages that
provide them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

__all__ = ["debian_package", "display_problem", "missing_libraries", "xcb_plugin"]

_NOT_FOUND = re.compile(r"^\s*(\S+)\s+=>\s+not found\s*$", re.MULTILINE)
_SONAME = re.compile(r"^lib(.+)\.so\.(\d+)(?:\..*)?$")


def debian_package(soname: str) -> str:
    """The Debian/Ubuntu package that ships a library: ``libxcb-cursor.so.0`` -> ``libxcb-cursor0``,
    ``libxkbcommon-x11.so.0`` -> ``libxkbcommon-x11-0`` (Debian policy: name + soversion, with a
    hyphen when the name ends in a digit)."""
    m = _SONAME.match(soname)
    if m is None:
        return soname
    name, version = m.group(1).lower(), m.group(2)
    return f"lib{name}{'-' if name[-1].isdigit() else ''}{version}"


def xcb_plugin() -> Path | None:
    """Qt's X11 platform plugin as installed with PySide6 (None if it is not found)."""
    try:
        import PySide6
    except ImportError:
        return None
    base = Path(PySide6.__file__).parent
    for candidate in (
        base / "Qt" / "plugins" / "platforms" / "libqxcb.so",
        base / "plugins" / "platforms" / "libqxcb.so",
    ):
        if candidate.is_file():
            return candidate
    return None


def missing_libraries(binary: Path) -> list[str]:
    """Shared libraries ``binary`` needs (directly or not) that the dynamic loader cannot find."""
    ldd = shutil.which("ldd")
    if ldd is None:
        return []
    try:
        out = subprocess.run([ldd, str(binary)], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return list(dict.fromkeys(_NOT_FOUND.findall(out)))


def _uses_xcb(env: dict[str, str]) -> bool:
    platform = env.get("QT_QPA_PLATFORM", "")
    if platform:
        return platform.split(":", 1)[0] == "xcb"
    wayland = env.get("WAYLAND_DISPLAY") or env.get("XDG_SESSION_TYPE") == "wayland"
    return bool(env.get("DISPLAY")) and not wayland


def display_problem(env: dict[str, str] | None = None) -> str | None:
    """Why the window cannot open here, in one line; None when nothing is known to be wrong."""
    env = dict(os.environ if env is None else env)
    if not sys.platform.startswith("linux"):
        return None
    if not any(env.get(v) for v in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")):
        return (
            "no display to open the window on (DISPLAY is not set); run it under xvfb-run, "
            "or use `dcpstudio demo` / the other subcommands on the terminal"
        )
    if not _uses_xcb(env):
        return None
    plugin = xcb_plugin()
    missing = missing_libraries(plugin) if plugin is not None else []
    if not missing:
        return None
    packages = " ".join(dict.fromkeys(debian_package(s) for s in missing))
    return (
        f"the window needs system libraries that are missing ({', '.join(missing)}); "
        f"install them with `sudo apt-get install {packages}` (Debian/Ubuntu), "
        "or use the subcommands, which need no display"
    )
