/* Hostile-suite probe: one precise syscall attempt per subcommand, uploaded into a
 * sandbox and run there. Prints "<name>: ok[ detail]" or "<name>: err <errno> <text>".
 * Built static on the host by crates/space/tests/hostile.rs (gcc -static). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/bpf.h>
#include <linux/perf_event.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/sysmacros.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <linux/if_ether.h>

static int report(const char *name, long rc) {
    if (rc < 0) {
        int e = errno;
        printf("%s: err %d %s\n", name, e, strerror(e));
        return 1;
    }
    printf("%s: ok %ld\n", name, rc);
    return 0;
}

static void *sleeper(void *x) { (void)x; for (;;) pause(); return 0; }

static int write_file(const char *path, const char *text) {
    int fd = open(path, O_WRONLY);
    if (fd < 0) return -1;
    ssize_t n = write(fd, text, strlen(text));
    int e = errno;
    close(fd);
    errno = e;
    return n < 0 ? -1 : 0;
}

/* Appends a marker to an open file: a write that lands shows on the host's copy. */
static int scribble(const char *name, int fd) {
    struct stat st;
    if (fstat(fd, &st) < 0) return report(name, -1);
    return report(name, pwrite(fd, "SCRIBBLE", 8, st.st_size));
}

static int unix_connect(const char *path) {
    int s = socket(AF_UNIX, SOCK_STREAM, 0);
    if (s < 0) return -1;
    struct sockaddr_un a; memset(&a, 0, sizeof a);
    a.sun_family = AF_UNIX;
    strncpy(a.sun_path, path, sizeof a.sun_path - 1);
    if (connect(s, (struct sockaddr *)&a, sizeof a) < 0) { int e = errno; close(s); errno = e; return -1; }
    return s;
}

int main(int argc, char **argv) {
    if (argc < 2) { fprintf(stderr, "usage: probe CASE [ARGS]\n"); return 2; }
    const char *c = argv[1];
    if (!strcmp(c, "ptrace1")) {
        long rc = ptrace(PTRACE_ATTACH, 1, 0, 0);
        if (rc == 0) {
            int st; waitpid(1, &st, __WALL);
            ptrace(PTRACE_DETACH, 1, 0, 0);
        }
        return report(c, rc);
    }
    if (!strcmp(c, "raw_inet")) return report(c, socket(AF_INET, SOCK_RAW, IPPROTO_ICMP));
    if (!strcmp(c, "packet")) return report(c, socket(AF_PACKET, SOCK_RAW, htons(ETH_P_ALL)));
    if (!strcmp(c, "unshare_user")) return report(c, unshare(CLONE_NEWUSER));
    if (!strcmp(c, "unshare_mnt_net")) return report(c, unshare(CLONE_NEWNS | CLONE_NEWNET));
    if (!strcmp(c, "mount_tmpfs")) return report(c, mount("none", argv[2], "tmpfs", 0, 0));
    if (!strcmp(c, "umount_root")) return report(c, umount2("/", MNT_DETACH));
    if (!strcmp(c, "chroot_escape")) {
        /* The classic escape: chroot into a subdir while keeping the cwd outside,
         * walk up, chroot("."), then look for a host file. */
        mkdir("/tmp/jail", 0755);
        if (chroot("/tmp/jail") < 0) return report("chroot", -1);
        for (int i = 0; i < 64; i++) if (chdir("..") < 0) break;
        if (chroot(".") < 0) return report("chroot2", -1);
        return report(c, open(argv[2], O_RDONLY));
    }
    if (!strcmp(c, "init_module")) {
        char junk[4096]; memset(junk, 0x41, sizeof junk);
        return report(c, syscall(SYS_init_module, junk, sizeof junk, ""));
    }
    if (!strcmp(c, "keyctl")) {
        /* add_key("user", desc, "x", 1, KEY_SPEC_SESSION_KEYRING) */
        return report(c, syscall(SYS_add_key, "user", argv[2], "x", 1, -3));
    }
    if (!strcmp(c, "bpf")) {
        struct bpf_insn prog[2];
        memset(prog, 0, sizeof prog);
        prog[0].code = BPF_ALU64 | BPF_MOV | BPF_K; prog[0].dst_reg = 0; prog[0].imm = 0;
        prog[1].code = BPF_JMP | BPF_EXIT;
        union bpf_attr a; memset(&a, 0, sizeof a);
        a.prog_type = BPF_PROG_TYPE_SOCKET_FILTER;
        a.insns = (unsigned long)prog; a.insn_cnt = 2;
        a.license = (unsigned long)"GPL";
        return report(c, syscall(SYS_bpf, BPF_PROG_LOAD, &a, sizeof a));
    }
    if (!strcmp(c, "perf")) {
        struct perf_event_attr a; memset(&a, 0, sizeof a);
        a.size = sizeof a; a.type = PERF_TYPE_SOFTWARE; a.config = PERF_COUNT_SW_CPU_CLOCK;
        /* every process on cpu 0: the system-wide view */
        return report(c, syscall(SYS_perf_event_open, &a, -1, 0, -1, 0));
    }
    if (!strcmp(c, "settime")) {
        struct timespec ts = { .tv_sec = 946684800, .tv_nsec = 0 }; /* 2000-01-01 */
        return report(c, clock_settime(CLOCK_REALTIME, &ts));
    }
    if (!strcmp(c, "sethostname")) return report(c, sethostname(argv[2], strlen(argv[2])));
    if (!strcmp(c, "kill")) return report(c, kill(atoi(argv[2]), SIGKILL));
    if (!strcmp(c, "mknod")) {
        /* a character device node (major, minor), then read from it */
        unlink(argv[2]);
        if (mknod(argv[2], S_IFCHR | 0600, makedev(atoi(argv[3]), atoi(argv[4]))) < 0)
            return report("mknod", -1);
        int fd = open(argv[2], O_RDONLY);
        if (fd < 0) return report("mknod_open", -1);
        char b[16];
        return report(c, read(fd, b, sizeof b));
    }
    if (!strcmp(c, "open_by_handle")) {
        /* "shocker": open a file by a forged handle (ext4 root inode 2) */
        struct { unsigned int bytes; int type; unsigned char h[8]; } fh;
        fh.bytes = 8; fh.type = 1; memset(fh.h, 0, 8); fh.h[0] = 2;
        return report(c, syscall(SYS_open_by_handle_at, AT_FDCWD, &fh, O_RDONLY));
    }
    if (!strcmp(c, "connect")) {
        /* TCP connect to ARGV[2]:ARGV[3], at most 3 s */
        int s = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
        if (s < 0) return report(c, -1);
        struct sockaddr_in sa; memset(&sa, 0, sizeof sa);
        sa.sin_family = AF_INET; sa.sin_port = htons(atoi(argv[3]));
        inet_pton(AF_INET, argv[2], &sa.sin_addr);
        int rc = connect(s, (struct sockaddr *)&sa, sizeof sa);
        if (rc < 0 && errno == EINPROGRESS) {
            struct pollfd p = { .fd = s, .events = POLLOUT };
            if (poll(&p, 1, 3000) == 0) { errno = ETIMEDOUT; return report(c, -1); }
            int err = 0; socklen_t l = sizeof err;
            getsockopt(s, SOL_SOCKET, SO_ERROR, &err, &l);
            if (err) { errno = err; return report(c, -1); }
            rc = 0;
        }
        return report(c, rc);
    }
    if (!strcmp(c, "userns")) {
        /* What `unshare -Urm` does: root of a new user namespace with a mount namespace of
         * its own (and so CAP_SYS_ADMIN over its mounts), then exec ARGV[2..]. Unlike
         * busybox's unshare, a missing /proc/self/setgroups (gVisor) is not an error. */
        uid_t uid = getuid(); gid_t gid = getgid();
        if (unshare(CLONE_NEWUSER | CLONE_NEWNS) < 0) return report(c, -1);
        char map[64];
        write_file("/proc/self/setgroups", "deny");
        snprintf(map, sizeof map, "0 %u 1", (unsigned)uid);
        if (write_file("/proc/self/uid_map", map) < 0) return report("userns_uid_map", -1);
        snprintf(map, sizeof map, "0 %u 1", (unsigned)gid);
        if (write_file("/proc/self/gid_map", map) < 0) return report("userns_gid_map", -1);
        fflush(stdout);
        execvp(argv[2], argv + 2);
        return report("userns_exec", -1);
    }
    if (!strcmp(c, "remount_rw")) {
        /* Both ways of lifting a read-only flag: the superblock's and the mount's. */
        report("remount_rw_sb", mount("none", argv[2], 0, MS_REMOUNT, 0));
        return report("remount_rw_bind", mount("none", argv[2], 0, MS_REMOUNT | MS_BIND, 0));
    }
    if (!strcmp(c, "openrw")) {
        /* open(O_RDWR) of ARGV[2], then a write at its end */
        int fd = open(argv[2], O_RDWR);
        if (fd < 0) return report(c, -1);
        return scribble(c, fd);
    }
    if (!strcmp(c, "fdreopen")) {
        /* open(O_RDONLY) of ARGV[2], then open(O_RDWR) of /proc/self/fd/N, then a write */
        int ro = open(argv[2], O_RDONLY);
        if (ro < 0) return report("fdreopen_ro", -1);
        char p[64]; snprintf(p, sizeof p, "/proc/self/fd/%d", ro);
        int fd = open(p, O_RDWR);
        if (fd < 0) return report(c, -1);
        return scribble(c, fd);
    }
    if (!strcmp(c, "truncate")) return report(c, truncate(argv[2], 0));
    if (!strcmp(c, "bind_unix")) {
        /* a listening Unix socket at ARGV[2] */
        int s = socket(AF_UNIX, SOCK_STREAM, 0);
        struct sockaddr_un a; memset(&a, 0, sizeof a);
        a.sun_family = AF_UNIX;
        strncpy(a.sun_path, argv[2], sizeof a.sun_path - 1);
        return report(c, bind(s, (struct sockaddr *)&a, sizeof a));
    }
    if (!strcmp(c, "hold_unix")) {
        /* ARGV[3] connections to the Unix socket ARGV[2], each sent half a hello line and
         * held open for ARGV[4] seconds; a connection the other side closes is made again. */
        int n = atoi(argv[3]), secs = atoi(argv[4]), made = 0, i;
        int *fds = calloc(n, sizeof *fds);
        const char *half = "{\"protocol\":1,\"sandbox_id\":\"";
        for (i = 0; i < n; i++) {
            fds[i] = unix_connect(argv[2]);
            if (fds[i] >= 0) { made++; (void)!write(fds[i], half, strlen(half)); }
        }
        printf("hold_unix: ok made %d\n", made);
        fflush(stdout);
        time_t end = time(0) + secs;
        long redials = 0;
        while (time(0) < end) {
            for (i = 0; i < n; i++) {
                char b[64];
                if (fds[i] >= 0) {
                    struct pollfd p = { .fd = fds[i], .events = POLLIN };
                    if (poll(&p, 1, 0) <= 0 || read(fds[i], b, sizeof b) > 0) continue;
                    close(fds[i]);
                }
                fds[i] = unix_connect(argv[2]);
                redials++;
                if (fds[i] >= 0) (void)!write(fds[i], half, strlen(half));
            }
            usleep(20000);
        }
        printf("hold_unix: redialled %ld\n", redials);
        return 0;
    }
    if (!strcmp(c, "close_stdout_and_run")) {
        /* close stdout and stderr, then keep running; writes a heartbeat file */
        close(1); close(2);
        for (int i = 0; ; i++) {
            FILE *f = fopen(argv[2], "w");
            if (f) { fprintf(f, "%d\n", i); fclose(f); }
            usleep(100000);
        }
    }
    /* ── issue 11 point 7: things that make a kernel run a usermode helper as root ── */
    if (!strcmp(c, "socket")) {
        /* socket(FAMILY, TYPE, PROTO): an unloaded family or protocol makes Linux call
         * request_module("net-pf-N[-proto-M]"), which runs the modprobe helper */
        int proto = argc > 4 ? atoi(argv[4]) : 0;
        return report(c, socket(atoi(argv[2]), atoi(argv[3]), proto));
    }
    if (!strcmp(c, "forkbomb")) {
        /* every process forks forever, whatever fails (issue 11 point 6) */
        for (;;) fork();
    }
    if (!strcmp(c, "request_key")) {
        /* request_key(TYPE, DESC, CALLOUT, session keyring): a key that does not exist,
         * with callout info, makes Linux run /sbin/request-key */
        return report(c, syscall(SYS_request_key, argv[2], argv[3], argv[4], -3));
    }
    if (!strcmp(c, "zombies")) {
        /* N children that exit and are never waited for, then sleep */
        int n = atoi(argv[2]);
        for (int i = 0; i < n; i++) if (fork() == 0) _exit(0);
        printf("zombies: made %d\n", n); fflush(stdout);
        sleep(atoi(argv[3]));
        return 0;
    }
    if (!strcmp(c, "threads")) {
        /* threads that sleep, until pthread_create fails or N are made */
        int n = atoi(argv[2]), i;
        pthread_attr_t a; pthread_attr_init(&a); pthread_attr_setstacksize(&a, 65536);
        for (i = 0; i < n; i++) {
            pthread_t t;
            int rc = pthread_create(&t, &a, sleeper, 0);
            if (rc) { printf("threads: err %d %s made %d\n", rc, strerror(rc), i); return 1; }
        }
        printf("threads: ok made %d\n", i);
        return 0;
    }
    if (!strcmp(c, "files")) {
        /* empty files in DIR until creat fails or N are made */
        int n = atoi(argv[3]), i;
        mkdir(argv[2], 0755);
        if (chdir(argv[2]) < 0) return report("files_chdir", -1);
        char name[32];
        for (i = 0; i < n; i++) {
            snprintf(name, sizeof name, "%x", i);
            int fd = open(name, O_CREAT | O_WRONLY | O_EXCL, 0644);
            if (fd < 0) { int e = errno; printf("files: err %d %s made %d\n", e, strerror(e), i); return 1; }
            close(fd);
        }
        printf("files: ok made %d\n", i);
        return 0;
    }
    if (!strcmp(c, "unix_socket")) {
        /* a Unix socket bound at ARGV[2] (the file stays after exit) */
        int s = socket(AF_UNIX, SOCK_STREAM, 0);
        if (s < 0) return report(c, -1);
        struct sockaddr_un sa; memset(&sa, 0, sizeof sa);
        sa.sun_family = AF_UNIX;
        strncpy(sa.sun_path, argv[2], sizeof sa.sun_path - 1);
        return report(c, bind(s, (struct sockaddr *)&sa, sizeof sa));
    }
    fprintf(stderr, "unknown case %s\n", c);
    return 2;
}
