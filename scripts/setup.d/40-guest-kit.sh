# The guest kit (kernel, initramfs, tools drive) and the `base` template rootfs, built from Debian packages and
# cached by content hash under the images cache dir (default $AENV_STATE_DIR): a no-op when nothing changed.
need_apt apt dpkg e2fsprogs debootstrap busybox-static lz4 cpio qemu-utils qemu-system-x86
if "$VENV/bin/aenv-node" kit --help >/dev/null 2>&1; then
    _kit_cli=("$VENV/bin/aenv-node")
else  # before the group is registered in aenv-node
    _kit_cli=("$VENV/bin/python" -m aenv_node.cli.kit)
fi
log "guest kit (aenv-node kit build)"
"${_kit_cli[@]}" kit build --state-dir "$AENV_STATE_DIR" >/dev/null
log "base rootfs (aenv-node rootfs build-base)"
"${_kit_cli[@]}" rootfs build-base --state-dir "$AENV_STATE_DIR" >/dev/null
unset _kit_cli
