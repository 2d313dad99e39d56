# aenv-seccomp-exec: the tiny C helper that starts a VMM under the seccomp filter of aenv_node/vmm/seccomp.py
# (a vfork+exec instead of forking the whole node from Python). Compiled into the venv's bin, next to the
# python that looks for it; rebuilt when its source changes (a stamp holds the source's sha256).
_seccomp_exec() {
    local src="$ROOT/aenv_node/vmm/native/seccomp_exec.c"
    local out="$VENV/bin/aenv-seccomp-exec"
    local want
    want="$(sha256sum "$src" | cut -d' ' -f1)"
    if [ -x "$out" ] && [ "$(cat "$out.sha256" 2>/dev/null)" = "$want" ]; then
        log "aenv-seccomp-exec up to date"
        return 0
    fi
    need_apt gcc libc6-dev
    log "compiling aenv-seccomp-exec"
    gcc -O2 -Wall -Wextra -Werror -o "$out.tmp" "$src"
    mv "$out.tmp" "$out"
    echo "$want" > "$out.sha256"
}
_seccomp_exec
