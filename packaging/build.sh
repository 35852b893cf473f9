#!/usr/bin/env bash
# Build the self-contained bundle (PyInstaller, one folder) and the .deb into dist/.
#   packaging/build.sh            -> dist/dcpstudio/ and dist/dcpstudio_<version>_<arch>.deb
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=$(python -c "import tomllib; print(tomllib.load(open('pyproject.toml', 'rb'))['project']['version'])")
ARCH=$(dpkg --print-architecture 2>/dev/null || uname -m)
start=$(date +%s)

# the bundle takes the package's own dependency specifiers (e.g. the PySide6 release it excludes)
mapfile -t deps < <(python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))")
python -m pip install --quiet "pyinstaller>=6.10" "${deps[@]}"
rm -rf build/pkgsite build/pyinstaller dist/dcpstudio "build/deb"
# PyInstaller cannot follow an editable install's folder mapping: give it a plain install of the package
python -m pip install --quiet --no-deps --no-build-isolation --target build/pkgsite .
DCPSTUDIO_SITE="$PWD/build/pkgsite" python -m PyInstaller --noconfirm --log-level WARN \
    --distpath dist --workpath build/pyinstaller packaging/dcpstudio.spec
# strip debug symbols, except auditwheel-repaired libraries (*.libs/): stripping breaks their patched headers
find dist/dcpstudio -type f \( -name '*.so' -o -name '*.so.*' \) ! -path '*.libs/*' -exec strip --strip-unneeded {} + 2>/dev/null || true

root="build/deb/dcpstudio_${VERSION}_${ARCH}"
mkdir -p "$root/DEBIAN" "$root/opt" "$root/usr/bin" "$root/usr/share/applications" \
    "$root/usr/share/icons/hicolor/scalable/apps" "$root/usr/share/mime/packages"
cp -a dist/dcpstudio "$root/opt/dcpstudio"
ln -s /opt/dcpstudio/dcpstudio "$root/usr/bin/dcpstudio"
cp resources/dcpstudio.desktop "$root/usr/share/applications/dcpstudio.desktop"
cp resources/dcpstudio.svg "$root/usr/share/icons/hicolor/scalable/apps/dcpstudio.svg"
cp packaging/dcpstudio-mime.xml "$root/usr/share/mime/packages/dcpstudio.xml"
size_kb=$(du -sk "$root" | cut -f1)
sed -e "s/@VERSION@/$VERSION/" -e "s/@ARCH@/$ARCH/" -e "s/@SIZE@/$size_kb/" packaging/deb-control > "$root/DEBIAN/control"
install -m 755 packaging/deb-postinst "$root/DEBIAN/postinst"
install -m 755 packaging/deb-postinst "$root/DEBIAN/postrm"
deb="dist/dcpstudio_${VERSION}_${ARCH}.deb"
dpkg-deb --root-owner-group -Zzstd --build "$root" "$deb" >/dev/null

echo "bundle: $(du -sh dist/dcpstudio | cut -f1)  deb: $(du -h "$deb" | cut -f1) ($deb)  build: $(( $(date +%s) - start )) s"
