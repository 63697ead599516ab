/* The syscall probe of tests/hostd/boundary.rs, built by the test with `cc -static` and run
 * inside a sandbox: tries each syscall the sandbox's seccomp filter must refuse (Docker's deny
 * set, io_uring, a 32-bit syscall) plus a few it must allow, and prints one line per try:
 * `<name> <errno>` (0 = the call succeeded; `sig<N>` = the try was killed by signal N).
 * x86-64 only (syscall numbers, the int 0x80 try). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

static void report(const char *name, long ret) {
    printf("%s %d\n", name, ret < 0 ? errno : 0);
}

/* Runs `try` in a child, so a call that succeeds changes nothing here and one that kills its
 * caller is reported as a signal. The child exits with the errno (0 on success). */
static void isolated(const char *name, long (*try)(void)) {
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        long ret = try();
        _exit(ret < 0 ? errno : 0);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    if (WIFSIGNALED(status))
        printf("%s sig%d\n", name, WTERMSIG(status));
    else
        printf("%s %d\n", name, WEXITSTATUS(status));
}

static long try_unshare_user(void) { return syscall(SYS_unshare, CLONE_NEWUSER); }
static long try_unshare_mount(void) { return syscall(SYS_unshare, CLONE_NEWNS); }
static long try_clone_user(void) {
    long ret = syscall(SYS_clone, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0);
    if (ret == 0)
        _exit(0);
    return ret;
}
static long try_clone3_user(void) {
    uint64_t args[11];
    memset(args, 0, sizeof args);
    args[0] = CLONE_NEWUSER;  /* flags */
    args[4] = SIGCHLD;        /* exit_signal */
    long ret = syscall(435 /* clone3 */, args, sizeof args);
    if (ret == 0)
        _exit(0);
    return ret;
}
static long try_fork(void) {
    long ret = syscall(SYS_clone, SIGCHLD, 0, 0, 0, 0);
    if (ret == 0)
        _exit(0);
    return ret < 0 ? ret : 0;
}
static long try_int80_getpid(void) {
    long ret;
    /* getpid through the 32-bit entry point (syscall 20 on i386). */
    __asm__ volatile("int $0x80" : "=a"(ret) : "a"(20L) : "memory");
    if (ret < 0) {
        errno = (int)-ret;
        return -1;
    }
    return 0;
}

int main(void) {
    int netns = open("/proc/self/ns/net", O_RDONLY);
    isolated("unshare_user", try_unshare_user);
    isolated("unshare_mount", try_unshare_mount);
    isolated("clone_newuser", try_clone_user);
    isolated("clone3_newuser", try_clone3_user);
    report("setns", syscall(SYS_setns, netns, CLONE_NEWNET));
    report("mount", syscall(SYS_mount, "none", "/tmp", "tmpfs", 0, 0));
    report("umount2", syscall(SYS_umount2, "/tmp", 0));
    report("pivot_root", syscall(SYS_pivot_root, ".", "."));
    report("open_tree", syscall(428, AT_FDCWD, "/", 0));
    report("move_mount", syscall(429, -1, "", AT_FDCWD, "/tmp", 0));
    report("fsopen", syscall(430, "tmpfs", 0));
    report("fsmount", syscall(432, -1, 0, 0));
    report("mount_setattr", syscall(442, AT_FDCWD, "/", 0, 0, 0));
    report("keyctl", syscall(SYS_keyctl, 0 /* GET_KEYRING_ID */, -3 /* session */, 0));
    report("add_key", syscall(SYS_add_key, "user", "berth", "x", 1, -2 /* process */));
    report("request_key", syscall(SYS_request_key, "user", "berth", 0, 0));
    report("bpf", syscall(SYS_bpf, 0, 0, 0));
    report("userfaultfd", syscall(SYS_userfaultfd, 0));
    report("perf_event_open", syscall(SYS_perf_event_open, 0, 0, -1, -1, 0));
    report("io_uring_setup", syscall(425, 1, 0));
    report("kexec_load", syscall(SYS_kexec_load, 0, 0, 0, 0));
    report("init_module", syscall(SYS_init_module, 0, 0, ""));
    report("finit_module", syscall(SYS_finit_module, -1, "", 0));
    report("delete_module", syscall(SYS_delete_module, "berth", 0));
    report("socket_vsock", syscall(SYS_socket, 40 /* AF_VSOCK */, SOCK_STREAM, 0));
    report("personality_no_aslr", syscall(SYS_personality, 0x0040000));
    isolated("int80_getpid", try_int80_getpid);
    /* Controls: these must work. */
    isolated("fork", try_fork);
    report("socket_tcp", syscall(SYS_socket, AF_INET, SOCK_STREAM, 0));
    report("personality_query", syscall(SYS_personality, 0xffffffff));
    return 0;
}
