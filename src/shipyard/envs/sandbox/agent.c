/* shipyard-agent: the session command server of a bubblewrap sandbox.
 *
 * Built once per machine by shipyard/envs/sandbox/agent.py and executed from a sealed memfd, so
 * no mount is needed to bring it into a sandbox and nothing inside can modify it. Freestanding
 * (no C library: raw system calls, x86_64 and aarch64 only), so it maps a few pages instead of
 * a libc: an idle agent is about 0.03 MiB resident where a /bin/sh server is 1.7 MiB.
 *
 *   agent serve SELF_FD OUT_FD CORE AS_KIB FSIZE_BLOCKS NPROC
 *       inside the sandbox: close SELF_FD (the memfd it was executed from), set the rlimits
 *       (both soft and hard, like `ulimit` in dash: core size, address space in KiB, file size in
 *       512-byte blocks, processes), then serve commands. The protocol is the one of the /bin/sh
 *       server in bwrap.py: frames "SEQ NLINES CPU_S\n" + NLINES lines on fd 0; each command runs
 *       as `/bin/sh -c CMD` with stdin /dev/null, stdout OUT_FD, stderr fd 2 and RLIMIT_CPU CPU_S;
 *       once it exits the agent kills every other process of the pid namespace (kill(-1)),
 *       reaps its children and answers "SEQ STATUS\n" on fd 1 (STATUS as a shell's $?: the exit
 *       code, or 128 + the signal number, after printing the signal's name on stderr as dash
 *       does). EOF on fd 0 ends the agent. It refuses to serve
 *       unless it is pid 1 or 2 (of the sandbox's pid namespace): kill(-1) on the host would
 *       kill every process the user may signal.
 *
 * Limits: a command longer than MAX_CMD bytes is refused with status 126 and a message on stderr
 * (the /bin/sh server has no such limit); a malformed frame header ends the agent (exit 3).
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>

#define MAX_CMD (64UL * 1024 * 1024)
#define EINTR_ 4

#if defined(__x86_64__)
static long sys6(long n, long a, long b, long c, long d, long e, long f) {
    register long r10 __asm__("r10") = d;
    register long r8 __asm__("r8") = e;
    register long r9 __asm__("r9") = f;
    long ret;
    __asm__ volatile("syscall"
                     : "=a"(ret)
                     : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8), "r"(r9)
                     : "rcx", "r11", "memory");
    return ret;
}
__asm__(".text\n.global _start\n_start:\n xor %rbp, %rbp\n mov %rsp, %rdi\n and $-16, %rsp\n"
        " call start_c\n hlt\n");
#elif defined(__aarch64__)
static long sys6(long n, long a, long b, long c, long d, long e, long f) {
    register long x8 __asm__("x8") = n;
    register long x0 __asm__("x0") = a;
    register long x1 __asm__("x1") = b;
    register long x2 __asm__("x2") = c;
    register long x3 __asm__("x3") = d;
    register long x4 __asm__("x4") = e;
    register long x5 __asm__("x5") = f;
    __asm__ volatile("svc 0" : "+r"(x0) : "r"(x8), "r"(x1), "r"(x2), "r"(x3), "r"(x4), "r"(x5) : "memory");
    return x0;
}
__asm__(".text\n.global _start\n_start:\n mov x29, #0\n mov x30, #0\n mov x0, sp\n bl start_c\n");
#else
#error "shipyard-agent: only x86_64 and aarch64 are supported"
#endif

#define sys3(n, a, b, c) sys6((n), (long)(a), (long)(b), (long)(c), 0, 0, 0)

/* The compiler may emit calls to these for struct copies and zeroing. */
void *memset(void *dst, int c, unsigned long n) {
    unsigned char *d = dst;
    while (n--) *d++ = (unsigned char)c;
    return dst;
}
void *memcpy(void *dst, const void *src, unsigned long n) {
    unsigned char *d = dst;
    const unsigned char *s = src;
    while (n--) *d++ = *s++;
    return dst;
}

static long xread(int fd, void *buf, unsigned long n) {
    long r;
    do {
        r = sys3(SYS_read, fd, buf, n);
    } while (r == -EINTR_);
    return r;
}

static int write_all(int fd, const char *s, unsigned long n) {
    while (n) {
        long w = sys3(SYS_write, fd, s, n);
        if (w == -EINTR_) continue;
        if (w <= 0) return -1;
        s += w;
        n -= (unsigned long)w;
    }
    return 0;
}

static unsigned long str_len(const char *s) {
    unsigned long n = 0;
    while (s[n]) n++;
    return n;
}

static void say(const char *msg) { (void)write_all(2, msg, str_len(msg)); }

static __attribute__((noreturn)) void quit(int code) {
    for (;;) sys3(SYS_exit_group, code, 0, 0);
}

/* A decimal number at *s (after spaces); 0 when there is none. */
static int parse_u64(const char **s, unsigned long long *out) {
    while (**s == ' ') (*s)++;
    if (**s < '0' || **s > '9') return 0;
    unsigned long long v = 0;
    while (**s >= '0' && **s <= '9') v = v * 10 + (unsigned long long)(*(*s)++ - '0');
    *out = v;
    return 1;
}

static unsigned long long number(const char *s) {
    unsigned long long v = 0;
    return parse_u64(&s, &v) ? v : 0;
}

static char in_buf[16384];
static unsigned long in_len, in_pos;

/* Next byte of fd 0, or -1 at EOF or error. */
static int next_byte(void) {
    if (in_pos == in_len) {
        long n = xread(0, in_buf, sizeof in_buf);
        if (n <= 0) return -1;
        in_len = (unsigned long)n;
        in_pos = 0;
    }
    return (unsigned char)in_buf[in_pos++];
}

struct buf {
    char *data;
    unsigned long len, cap;
    int overflow; /* a byte could not be stored: the command is refused */
};

static void append(struct buf *b, char c) {
    if (b->len + 2 > b->cap) {
        unsigned long ncap = b->cap ? b->cap * 2 : 16384;
        long p = ncap > MAX_CMD ? -1
                 : b->data
                     ? sys6(SYS_mremap, (long)b->data, (long)b->cap, (long)ncap, MREMAP_MAYMOVE, 0, 0)
                     : sys6(SYS_mmap, 0, (long)ncap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p < 0 && p > -4096) p = -1;
        if (p == -1) {
            b->overflow = 1;
            return;
        }
        b->data = (char *)p;
        b->cap = ncap;
    }
    b->data[b->len++] = c;
}

/* Append one line (without its newline) to b; 0 at EOF before the newline, else 1. */
static int read_line(struct buf *b) {
    for (;;) {
        int c = next_byte();
        if (c < 0) return 0;
        if (c == '\n') return 1;
        append(b, (char)c);
    }
}

static void set_limit(int resource, unsigned long long value) {
    unsigned long long rl[2] = {value, value};
    (void)sys6(SYS_prlimit64, 0, resource, (long)rl, 0, 0, 0);
}

static int move_fd(int from, int to) {
    if (from == to) return 0;
    return sys3(SYS_dup3, from, to, 0) < 0 ? -1 : 0;
}

/* What dash prints on stderr for a command a signal ended (strsignal's text; none for SIGINT, SIGPIPE). */
static const char *const SIGNAL_TEXT[32] = {
    0, "Hangup", 0, "Quit", "Illegal instruction", "Trace/breakpoint trap", "Aborted", "Bus error",
    "Floating point exception", "Killed", "User defined signal 1", "Segmentation fault",
    "User defined signal 2", 0, "Alarm clock", "Terminated", "Stack fault", "Child exited", "Continued",
    "Stopped (signal)", "Stopped", "Stopped (tty input)", "Stopped (tty output)", "Urgent I/O condition",
    "CPU time limit exceeded", "File size limit exceeded", "Virtual timer expired",
    "Profiling timer expired", "Window changed", "I/O possible", "Power failure", "Bad system call",
};

/* Run one command to completion; the shell-style status. */
static int run(char *cmd, int out_fd, unsigned long long cpu, char **envp) {
    long pid = sys6(SYS_clone, SIGCHLD, 0, 0, 0, 0, 0);
    if (pid < 0) return 126;
    if (pid == 0) {
        set_limit(RLIMIT_CPU, cpu);
        long null = sys6(SYS_openat, AT_FDCWD, (long)"/dev/null", O_RDONLY, 0, 0, 0);
        if (null < 0 || move_fd((int)null, 0) < 0 || move_fd(out_fd, 1) < 0) quit(126);
        if (null > 2) sys3(SYS_close, null, 0, 0);
        if (out_fd > 2) sys3(SYS_close, out_fd, 0, 0);
        char *args[] = {"/bin/sh", "-c", cmd, 0};
        sys3(SYS_execve, "/bin/sh", args, envp);
        quit(127);
    }
    int status = 0;
    while (sys6(SYS_wait4, pid, (long)&status, 0, 0, 0, 0) == -EINTR_) {
    }
    (void)sys3(SYS_kill, -1, SIGKILL, 0);
    for (;;) {
        long r = sys6(SYS_wait4, -1, 0, 0, 0, 0, 0);
        if (r < 0 && r != -EINTR_) break;
    }
    if (WIFEXITED(status)) return WEXITSTATUS(status);
    int sig = WTERMSIG(status);
    if (sig > 0 && sig < 32 && SIGNAL_TEXT[sig]) {
        say(SIGNAL_TEXT[sig]);
        say(WCOREDUMP(status) ? " (core dumped)\n" : "\n");
    }
    return 128 + sig;
}

/* "SEQ RC\n" into out (at least 48 bytes); its length. */
static unsigned long format_reply(char *out, unsigned long long seq, int rc) {
    char tmp[24];
    unsigned long len = 0;
    unsigned long long values[2] = {seq, (unsigned long long)rc};
    for (int k = 0; k < 2; k++) {
        unsigned long long v = values[k];
        int n = 0;
        do {
            tmp[n++] = (char)('0' + v % 10);
            v /= 10;
        } while (v);
        while (n) out[len++] = tmp[--n];
        out[len++] = k == 0 ? ' ' : '\n';
    }
    return len;
}

static int serve(int argc, char **argv, char **envp) {
    if (argc != 8) return 2;
    if (sys3(SYS_getpid, 0, 0, 0) > 2) {
        say("shipyard-agent: serve runs only as pid 1 or 2 of a sandbox's pid namespace\n");
        return 2;
    }
    sys3(SYS_prctl, 15 /* PR_SET_NAME */, "shipyard-agent", 0); /* not the memfd's fd number */
    /* not dumpable: code in the sandbox, same uid, can neither ptrace the agent nor open its
       /proc/<pid>/mem or fd/ (the commands it runs get a fresh, dumpable image at execve) */
    sys3(SYS_prctl, 4 /* PR_SET_DUMPABLE */, 0, 0);
    sys3(SYS_close, number(argv[2]), 0, 0);
    int out_fd = (int)number(argv[3]);
    set_limit(RLIMIT_CORE, number(argv[4]));
    set_limit(RLIMIT_AS, number(argv[5]) * 1024);
    set_limit(RLIMIT_FSIZE, number(argv[6]) * 512);
    set_limit(RLIMIT_NPROC, number(argv[7]));
    struct buf head = {0}, cmd = {0};
    for (;;) {
        head.len = cmd.len = 0;
        head.overflow = cmd.overflow = 0;
        if (!read_line(&head) || head.overflow) return 0;
        append(&head, '\0');
        unsigned long long seq = 0, lines = 0, cpu = 0;
        const char *p = head.data;
        if (!parse_u64(&p, &seq) || !parse_u64(&p, &lines) || !parse_u64(&p, &cpu) || *p) return 3;
        for (unsigned long long i = 0; i < lines; i++) {
            if (i > 0) append(&cmd, '\n');
            if (!read_line(&cmd)) return 0;
        }
        append(&cmd, '\0');
        int rc = 126;
        if (cmd.overflow) {
            say("shipyard-agent: command too long\n");
        } else {
            rc = run(cmd.data, out_fd, cpu, envp);
        }
        char reply[48];
        if (write_all(1, reply, format_reply(reply, seq, rc)) < 0) return 0;
    }
}

static int streq(const char *a, const char *b) {
    while (*a && *a == *b) a++, b++;
    return *a == *b;
}

__attribute__((noreturn, used)) void start_c(long *sp) {
    int argc = (int)sp[0];
    char **argv = (char **)(sp + 1);
    char **envp = argv + argc + 1;
    if (argc >= 2 && streq(argv[1], "serve")) quit(serve(argc, argv, envp));
    say("usage: agent serve SELF_FD OUT_FD CORE AS_KIB FSIZE_BLOCKS NPROC\n");
    quit(2);
}
