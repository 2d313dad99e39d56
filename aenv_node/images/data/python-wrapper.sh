#!/opt/aenv/bin/busybox sh
# /opt/aenv/bin/python: run the tools drive's own Python through its own dynamic loader and libraries, so it
# works on any guest distro (glibc of another version, musl, or no libc at all) and never reads the image's
# /lib. Nothing is put into the environment, so programs started from Python see the guest's normal setup.
exec /opt/aenv/lib/ld-linux-x86-64.so.2 --library-path /opt/aenv/lib \
    --argv0 /opt/aenv/python/bin/python3.11 /opt/aenv/python/bin/python3.11 "$@"
