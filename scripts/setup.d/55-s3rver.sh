# s3rver: a small file-backed S3-compatible server (Node), used by the storage tests and bench/cache_fetch.py
# for large objects.  moto (the main test server) copies a whole object on every ranged GET (~1 s per GET at
# 1 GiB) and takes ~50 s to store 1 GiB, so the 1 GiB layer test and the cache benchmark use s3rver when it is
# present.  Installed into the venv directory (already git-ignored, dev/CI only).
S3RVER_VERSION=3.7.1
S3RVER_DIR="$VENV/s3rver"
if ! command -v npm >/dev/null 2>&1; then
    need_apt nodejs npm
fi
if ! grep -qs "\"version\": \"$S3RVER_VERSION\"" "$S3RVER_DIR/node_modules/s3rver/package.json"; then
    log "npm install s3rver@$S3RVER_VERSION into $S3RVER_DIR"
    mkdir -p "$S3RVER_DIR"
    npm install --prefix "$S3RVER_DIR" --no-audit --no-fund --silent "s3rver@$S3RVER_VERSION" >/dev/null
fi
