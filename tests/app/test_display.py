"""Before Qt can abort the process, a missing display or system library is one actionable line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dcpstudio.window import display


@pytest.mark.parametrize(
    ("soname", "package"),
    [
        ("libxcb-cursor.so.0", "libxcb-cursor0"),
        ("libxcb-render-util.so.0", "libxcb-render-util0"),
        ("libxkbcommon-x11.so.0", "libxkbcommon-x11-0"),
        ("libX11-xcb.so.1", "libx11-xcb1"),
        ("libdbus-1.so.3", "libdbus-1-3"),
        ("libEGL.so.1", "libegl1"),
    ],
)
def test_debian_package_names(soname: str, package: str) -> None:
    assert display.debian_package(soname) == package


def test_missing_libraries_are_named_with_their_packages(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    plugin = tmp_path / "libqxcb.so"
    plugin.write_bytes(b"")
    monkeypatch.setattr(display, "xcb_plugin", lambda: plugin)
    monkeypatch.setattr(display, "missing_libraries", lambda p: ["libxcb-cursor.so.0", "libxkbcommon-x11.so.0"])
    problem = display.display_problem({"DISPLAY": ":0"})
    assert problem is not None and "\n" not in problem
    assert "apt-get install libxcb-cursor0 libxkbcommon-x11-0" in problem
    # not checked where Qt will not use xcb
    assert display.display_problem({"DISPLAY": ":0", "QT_QPA_PLATFORM": "offscreen"}) is None
    assert display.display_problem({"DISPLAY": ":0", "WAYLAND_DISPLAY": "wayland-0"}) is None
    assert display.display_problem({"DISPLAY": ":0", "QT_QPA_PLATFORM": "xcb"}) is not None
    assert "xvfb-run" in (display.display_problem({}) or "")


def test_ldd_output_is_parsed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = tmp_path / "ldd"
    fake.write_text(
        "#!/bin/sh\n"
        "printf '\\tlibQt6XcbQpa.so.6 => /x/libQt6XcbQpa.so.6 (0x1)\\n'\n"
        "printf '\\tlibxcb-icccm.so.4 => not found\\n\\tlibxcb-icccm.so.4 => not found\\n'\n"
        "printf '\\tlibxcb-keysyms.so.1 => not found\\n'\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert display.missing_libraries(tmp_path) == ["libxcb-icccm.so.4", "libxcb-keysyms.so.1"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="xcb is the Linux platform")
def test_the_command_says_it_in_one_line_where_libraries_are_missing(tmp_path: Path) -> None:
    plugin = display.xcb_plugin()
    if plugin is None or not display.missing_libraries(plugin):
        pytest.skip("this machine has every library Qt's xcb plugin needs")
    env = {k: v for k, v in os.environ.items() if k not in ("QT_QPA_PLATFORM", "WAYLAND_DISPLAY")}
    env.update(DISPLAY=":97", HOME=str(tmp_path))
    cmd = [sys.executable, "-m", "dcpstudio", "--quit-after", "1"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dcpstudio: error: the window needs system libraries"), lines
    assert "sudo apt-get install" in lines[0]


def test_sigterm_closes_the_window_like_quit(tmp_path: Path) -> None:
    """SIGTERM and SIGHUP go through the window's close (jobs cancelled, temporaries removed,
    settings saved) instead of killing the process mid-write."""
    import signal
    import time

    pt = tmp_path / "m.pt"
    pt.write_bytes(b"")  # any path: the window opens and shows the error
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "XDG_CONFIG_HOME": str(tmp_path / "config")}
    proc = subprocess.Popen([sys.executable, "-m", "dcpstudio", "open", str(pt)], env=env)
    status = Path(f"/proc/{proc.pid}/status")
    if status.exists():  # until the window catches SIGTERM (a loaded machine starts it late), not a fixed time
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            caught = next(line.split()[1] for line in status.read_text().splitlines() if line.startswith("SigCgt:"))
            if int(caught, 16) >> (signal.SIGTERM - 1) & 1:
                break
            time.sleep(0.05)
        time.sleep(0.5)  # the event loop running
    else:
        time.sleep(3)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert any((tmp_path / "config").rglob("*.conf")), "the window's settings were not saved on the way out"
