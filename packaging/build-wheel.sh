#!/usr/bin/env bash
# Build the wheel and sdist of dcpstudio into packaging/dist/ (the installer build starts from these).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip wheel --no-deps --no-build-isolation -w packaging/dist . >/dev/null
python - <<'PY'
import pathlib, zipfile
wheel = max(pathlib.Path("packaging/dist").glob("dcpstudio-*.whl"))
names = zipfile.ZipFile(wheel).namelist()
for required in ("dcpstudio/__init__.py", "dcpstudio/core/convert.py", "dcpstudio/app/__init__.py"):
    assert required in names, f"{required} missing from {wheel}"
print(wheel)
PY
