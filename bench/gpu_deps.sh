# Sourced by the GPU session scripts: the CMake generator and, when DEPS is set, the Debian
# packages' files carried to a machine without them. DEPS: a folder holding the packages'
# installed files (usr/...) — the lent GPU image has none of scripts/install-deps.sh's
# packages; DEPS/fallback holds shared libraries they need that the machine may lack (brotli,
# OpenSSL 3), used only then. Sets GEN (cmake arguments) and the library/pkg-config paths;
# notes go to $OUT/env.txt.
GEN=()
command -v ninja > /dev/null && GEN=(-G Ninja)
if [[ -n "${DEPS:-}" ]]; then
  DEPS=$(cd "$DEPS" && pwd)
  LIB=$DEPS/usr/lib/x86_64-linux-gnu
  export LD_LIBRARY_PATH=$LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  for so in libssl.so.3 libcrypto.so.3 libbrotlienc.so.1 libbrotlidec.so.1 libz.so.1; do
    if ! ldconfig -p | grep -q "$so"; then
      echo "no $so here: using $DEPS/fallback" >> "$OUT/env.txt"
      export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$DEPS/fallback
      break
    fi
  done
  export PKG_CONFIG_SYSROOT_DIR=$DEPS PKG_CONFIG_LIBDIR=$LIB/pkgconfig
  GEN+=(-DCMAKE_PREFIX_PATH="$DEPS/usr")
  command -v pkg-config > /dev/null || GEN+=(-DPKG_CONFIG_EXECUTABLE="$DEPS/usr/bin/pkgconf")
  echo "DEPS=$DEPS LD_LIBRARY_PATH=$LD_LIBRARY_PATH" >> "$OUT/env.txt"
fi
