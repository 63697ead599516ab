/*
 * berth's statx shim for gVisor sandboxes, preloaded (LD_PRELOAD) into the processes the agent
 * starts in a runsc sandbox.
 *
 * gVisor release 20221219 (Debian's runsc) refuses the AT_NO_AUTOMOUNT flag in statx(2) and
 * newfstatat(2) with EINVAL; coreutils 9 (ls -l, stat, cp -a, ...) passes it on every call, so
 * those tools fail with "Invalid argument" on every path. AT_NO_AUTOMOUNT only stops the
 * kernel from triggering an automount, and gVisor has no automounts: dropping the flag changes
 * no answer. These wrappers drop it and make the system call through libc's syscall(), which
 * sets errno; they need nothing else from libc, so one build serves glibc and musl roots.
 *
 * A statically linked program, or one that issues the system call itself, is not helped.
 */
#include <sys/syscall.h>

#define BERTH_AT_NO_AUTOMOUNT 0x800

extern long syscall(long number, ...);

struct statx;
struct stat;

int statx(int dirfd, const char *path, int flags, unsigned int mask, struct statx *buf)
{
    return (int)syscall(SYS_statx, dirfd, path, flags & ~BERTH_AT_NO_AUTOMOUNT, mask, buf);
}

int fstatat(int dirfd, const char *path, struct stat *buf, int flags)
{
    return (int)syscall(SYS_newfstatat, dirfd, path, buf, flags & ~BERTH_AT_NO_AUTOMOUNT);
}

int fstatat64(int dirfd, const char *path, struct stat *buf, int flags)
{
    return (int)syscall(SYS_newfstatat, dirfd, path, buf, flags & ~BERTH_AT_NO_AUTOMOUNT);
}
