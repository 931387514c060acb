#!/usr/bin/env bash
# Builds hostdevd's .deb and .rpm into target/packages/ (what `make package` runs).
#
#   scripts/package.sh                       both packages, version from Cargo.toml
#   scripts/package.sh --deb-revision 2      a later Debian revision / RPM release (tests)
#   scripts/package.sh --out DIR             write the packages to DIR instead
#   scripts/package.sh --no-build            package the release binaries already built
#
# Steps: the release binaries (cargo build --release --locked), stripped copies and man
# pages generated from the binaries' own --help in target/packages/stage/, then cargo-deb
# and cargo-generate-rpm read [package.metadata.deb] / [package.metadata.generate-rpm] in
# Cargo.toml. Both tools are installed with `cargo install --locked` into target/tools/
# when missing (from crates.io). Needs: binutils (strip), python3, gzip, dpkg-dev
# (dpkg-shlibdeps, for the .deb's library dependencies).
set -euo pipefail
cd "$(dirname "$0")/.."

revision=1
out=target/packages
build=1
while [ $# -gt 0 ]; do
  case "$1" in
    --deb-revision) revision="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --no-build) build=0; shift ;;
    *) echo "package.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

missing=()
command -v strip >/dev/null 2>&1 || missing+=(binutils)
command -v python3 >/dev/null 2>&1 || missing+=(python3)
command -v dpkg-shlibdeps >/dev/null 2>&1 || missing+=(dpkg-dev)
command -v gzip >/dev/null 2>&1 || missing+=(gzip)
if [ "${#missing[@]}" -gt 0 ]; then
  echo "package.sh: missing tools; run: sudo apt-get install ${missing[*]}" >&2
  exit 1
fi

# The packaging tools, pinned so that CI and developers build the same packages.
CARGO_DEB_VERSION=3.8.0
CARGO_GENERATE_RPM_VERSION=0.21.1
tools=target/tools
tool() { # name version
  local bin="$tools/bin/$1"
  if [ -x "$bin" ] && "$bin" --version 2>/dev/null | grep "$2" >/dev/null; then
    return
  fi
  echo "package.sh: installing $1 $2 into $tools" >&2
  cargo install --quiet --locked --root "$tools" "$1" --version "$2"
}
tool cargo-deb "$CARGO_DEB_VERSION"
tool cargo-generate-rpm "$CARGO_GENERATE_RPM_VERSION"
export PATH="$PWD/$tools/bin:$PATH"

if [ "$build" = 1 ]; then
  cargo build --quiet --release --locked --bins
fi
for b in hostdevd hostdevctl; do
  [ -x "target/release/$b" ] || { echo "package.sh: no target/release/$b (run without --no-build)" >&2; exit 1; }
done

stage=target/packages/stage
rm -rf "$stage"
mkdir -p "$stage" "$out"
# Release binaries keep line tables ([profile.release] debug = 1) for backtraces in
# development; the packages ship them stripped, as Debian's dh_strip would.
for b in hostdevd hostdevctl; do
  strip --strip-unneeded --remove-section=.comment --remove-section=.note \
    -o "$stage/$b" "target/release/$b"
done

# Man pages from the shipped binaries' --help, dated by the last commit (or
# SOURCE_DATE_EPOCH) so that rebuilding the same tree gives the same pages.
if [ -n "${SOURCE_DATE_EPOCH:-}" ]; then
  date=$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%d)
else
  date=$(git log -1 --format=%cs 2>/dev/null || date -u +%Y-%m-%d)
fi
for b in hostdevd hostdevctl; do
  python3 packaging/man/manpage.py "$stage/$b" 8 "packaging/man/$b.8.in" "$date" >"$stage/$b.8"
  gzip -9n "$stage/$b.8"
done

version=$(cargo metadata --no-deps --format-version 1 |
  python3 -c 'import json,sys; print(next(p["version"] for p in json.load(sys.stdin)["packages"] if p["name"] == "hostdevd"))')

cargo deb --quiet --no-build --no-strip --deb-revision "$revision" \
  --output "$out/hostdevd_${version}-${revision}_$(dpkg --print-architecture).deb"
cargo generate-rpm --set-metadata "release = \"$revision\"" --output "$out/"

echo "package.sh: built" >&2
ls -l "$out"/hostdevd_"${version}-${revision}"_*.deb "$out"/hostdevd-"${version}-${revision}".*.rpm >&2
