# The tiny C helpers that start a VMM (a vfork+exec each, instead of forking the whole node from Python or a
# chain of shell, nsenter and unshare): aenv-seccomp-exec installs the seccomp filter of
# aenv_node/vmm/seccomp.py; aenv-vmm-exec joins the VMM's cgroups, writes its pid file, enters its network
# namespace and makes its stable links (aenv_node/vmm/process.py). Compiled into the venv's bin, next to the
# python that looks for them; each rebuilt when its source changes (a stamp holds the source's sha256).
_native_helper() {
    local src="$ROOT/aenv_node/vmm/native/$1.c"
    local out="$VENV/bin/$2"
    local want
    want="$(sha256sum "$src" | cut -d' ' -f1)"
    if [ -x "$out" ] && [ "$(cat "$out.sha256" 2>/dev/null)" = "$want" ]; then
        log "$2 up to date"
        return 0
    fi
    need_apt gcc libc6-dev
    log "compiling $2"
    gcc -O2 -Wall -Wextra -Werror -o "$out.tmp" "$src"
    mv "$out.tmp" "$out"
    echo "$want" > "$out.sha256"
}
_native_helper seccomp_exec aenv-seccomp-exec
_native_helper vmm_exec aenv-vmm-exec
