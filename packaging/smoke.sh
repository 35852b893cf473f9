#!/usr/bin/env bash
# Smoke check of the installer: build (unless --no-build), extract the .deb into a temporary root,
# and from the extracted binary print the version, convert torch.save -> DCP -> torch.save and
# verify, run a 2-rank load, open the window offscreen and close it, validate the desktop entry.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${1:-}" = "--no-build" ] || packaging/build.sh
deb=$(ls -t dist/dcpstudio_*.deb | head -n 1)
root=$(mktemp -d)
work=$(mktemp -d)
trap 'rm -rf "$root" "$work"' EXIT
dpkg-deb -x "$deb" "$root"
bin="$root/opt/dcpstudio/dcpstudio"
"$bin" --version
python - "$work/model.pt" <<'PY'
import sys, torch
torch.save({"model": {"w": torch.randn(64, 32), "b": torch.randn(32).bfloat16()}, "step": 5}, sys.argv[1])
PY
"$bin" convert "$work/model.pt" "$work/model_dcp" -q
"$bin" convert "$work/model_dcp" "$work/back.pt" -q
"$bin" verify "$work/model.pt" "$work/back.pt" -q
"$bin" load "$work/model.pt" --ranks 2 --layout shard0 --timeout 180
QT_QPA_PLATFORM=offscreen "$bin" --quit-after 3 open "$work/model_dcp"
if command -v desktop-file-validate >/dev/null 2>&1; then
    desktop-file-validate "$root/usr/share/applications/dcpstudio.desktop"
fi
test -L "$root/usr/bin/dcpstudio" && test -f "$root/usr/share/mime/packages/dcpstudio.xml"
echo "smoke check passed: $deb"
