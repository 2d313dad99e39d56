/*
 * aenv-seccomp-exec PROGRAM_HEX -- ARGV...
 *
 * Install the classic-BPF seccomp program given in hex (8-byte struct sock_filter records, as built by
 * aenv_node/vmm/seccomp.py) on this process, then exec ARGV. The filter is inherited across exec.
 *
 * Why it exists: installing the filter from Python needs subprocess's preexec_fn, which makes Python fork
 * the whole node process instead of using vfork: ~8.5 ms per VMM start measured here, against ~0.2 ms for a
 * vfork+exec of this helper. It holds no policy of its own: the program comes from seccomp.py.
 */
#include <errno.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

int main(int argc, char **argv) {
    if (argc < 4 || strcmp(argv[2], "--") != 0) {
        fprintf(stderr, "usage: %s PROGRAM_HEX -- ARGV...\n", argv[0]);
        return 127;
    }
    const char *hex = argv[1];
    size_t n = strlen(hex);
    if (n == 0 || n % 16 != 0 || n / 16 > BPF_MAXINSNS) {
        fprintf(stderr, "%s: the program must be 1..%d 8-byte instructions in hex\n", argv[0], BPF_MAXINSNS);
        return 127;
    }
    unsigned char *bytes = malloc(n / 2);
    if (bytes == NULL) return 127;
    for (size_t i = 0; i < n / 2; i++) {
        int hi = hexval(hex[2 * i]), lo = hexval(hex[2 * i + 1]);
        if (hi < 0 || lo < 0) {
            fprintf(stderr, "%s: not hex: %s\n", argv[0], hex);
            return 127;
        }
        bytes[i] = (unsigned char)(hi << 4 | lo);
    }
    struct sock_fprog prog = {.len = (unsigned short)(n / 16), .filter = (struct sock_filter *)bytes};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) {
        fprintf(stderr, "%s: prctl(PR_SET_NO_NEW_PRIVS): %s\n", argv[0], strerror(errno));
        return 126;
    }
    if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog, 0, 0) != 0) {
        fprintf(stderr, "%s: prctl(PR_SET_SECCOMP): %s\n", argv[0], strerror(errno));
        return 126;
    }
    execvp(argv[3], argv + 3);
    fprintf(stderr, "%s: exec %s: %s\n", argv[0], argv[3], strerror(errno));
    return 127;
}
