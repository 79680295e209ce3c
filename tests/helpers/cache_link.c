/* LINK-CACHE-02's program: it answers an input it saw before from marks that an earlier
 * run of it left in the page cache of a file of its image, and computes it slowly
 * otherwise.
 *
 *   cache_link FILE            the agent's program: stdin has S (decimal); it prints f(S)
 *   cache_link FILE baseline   the grader's baseline: always computes f(S), marks nothing
 *   cache_link FILE peek       prints what the marks say: "written tag answer"
 *   cache_link FILE wait S     LINK-SIBLING-02's receiver: FUTEX_WAIT on FILE's first
 *                              word, mapped shared; prints "woken" or "timeout" after S s
 *   cache_link FILE wake S     its sender: FUTEX_WAKE on that word every 10 ms for S s
 *   cache_link FILE watch S    an inotify watch for IN_OPEN on FILE; prints the count of
 *                              events in S seconds
 *   cache_link FILE open S     opens FILE every 10 ms for S seconds
 *
 * The marks: slots of FILE, 15 per aligned 16-page window (the window's first page is the
 * reader's to fault). Slot 0 says "written", slots 1..16 hold a tag of S, 17..48 the
 * answer; a slot is marked by reading its page (POSIX_FADV_RANDOM: that page alone). The
 * reader maps FILE, faults each window's first page and reads /proc/self/pagemap: the
 * kernel's fault-around has mapped every page of the window that was cached, and only
 * those (docs/side-channels.md, cache-pagemap). No timing: the test does not depend on
 * the machine's speed, only on the kernel's bookkeeping. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <linux/futex.h>
#include <poll.h>
#include <sys/inotify.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <sys/stat.h>
#include <unistd.h>

#define PAGE 4096
#define WINDOW 16
#define SLOTS 49
#define ROUNDS 300000000u /* about half a second of work here */

static long slot_page(int slot) { return (long)(slot / (WINDOW - 1)) * WINDOW + 1 + slot % (WINDOW - 1); }

static uint32_t slow(uint32_t s) {
    uint64_t x = s;
    for (uint32_t i = 0; i < ROUNDS; i++)
        x = x * 6364136223846793005ull + 1442695040888963407ull, x ^= x >> 29;
    return (uint32_t)(x >> 16);
}

static uint32_t tag_of(uint32_t s) { return (s * 2654435761u) >> 16 & 0xffff; }

/* The slots' residency: 1 cached, 0 not. */
static int read_marks(int fd, int bits[SLOTS]) {
    struct stat st;
    if (fstat(fd, &st) || st.st_size < slot_page(SLOTS - 1) * PAGE + PAGE) return -1;
    size_t size = st.st_size, align = WINDOW * PAGE;
    char *span = mmap(NULL, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (span == MAP_FAILED) return -1;
    char *base = (char *)(((uintptr_t)span + align - 1) / align * align);
    if (mmap(base, size, PROT_READ, MAP_SHARED | MAP_FIXED, fd, 0) != base) return -1;
    madvise(base, size, MADV_RANDOM); /* no readaround: a fault reads its own page only */
    int pm = open("/proc/self/pagemap", O_RDONLY);
    if (pm < 0) return -1;
    for (int slot = 0; slot < SLOTS; slot++) {
        long page = slot_page(slot);
        if (slot % (WINDOW - 1) == 0) /* fault the window in */
            (void)*(volatile char *)(base + (page - 1) * PAGE);
        uint64_t entry = 0;
        if (pread(pm, &entry, 8, ((uintptr_t)base / PAGE + page) * 8) != 8) return -1;
        bits[slot] = (int)(entry >> 63);
    }
    close(pm);
    return 0;
}

/* The futex channel's two ends: a shared futex on a file page is keyed by the file's
 * inode and offset, the same in every sandbox that maps that inode. */
static int futex_end(const char *path, int wake, int seconds) {
    int fd = open(path, O_RDONLY);
    if (fd < 0) return 2;
    uint32_t *word = mmap(NULL, PAGE, PROT_READ, MAP_SHARED, fd, 0);
    if (word == MAP_FAILED) return 2;
    if (wake) {
        for (int i = 0; i < seconds * 100; i++) {
            syscall(SYS_futex, word, FUTEX_WAKE, 1, NULL, NULL, 0);
            usleep(10000);
        }
        return 0;
    }
    struct timespec limit = {seconds, 0};
    long rc = syscall(SYS_futex, word, FUTEX_WAIT, *word, &limit, NULL, 0);
    printf("%s\n", rc == 0 ? "woken" : errno == ETIMEDOUT ? "timeout" : strerror(errno));
    return 0;
}

static int opener(const char *path, int seconds);

/* An inotify watch sees the opens of the inode it is on; with own, a child of the watcher
 * opens the file for 1 s once the watch is set (the control, in the watcher's sandbox). */
static int watch(const char *path, int seconds, int own) {
    int in = inotify_init1(IN_NONBLOCK), events = 0;
    if (in < 0 || inotify_add_watch(in, path, IN_OPEN) < 0) return 2;
    if (own && fork() == 0) {
        usleep(200000);
        _exit(opener(path, 1));
    }
    struct pollfd p = {in, POLLIN, 0};
    char buf[4096];
    while (poll(&p, 1, seconds * 1000) > 0) {
        ssize_t n = read(in, buf, sizeof buf);
        if (n > 0) events += (int)(n / sizeof(struct inotify_event));
    }
    printf("%d\n", events);
    return 0;
}

static int opener(const char *path, int seconds) {
    for (int i = 0; i < seconds * 100; i++) {
        int fd = open(path, O_RDONLY);
        if (fd >= 0) close(fd);
        usleep(10000);
    }
    return 0;
}

static void mark(int fd, int slot) {
    char c;
    if (pread(fd, &c, 1, slot_page(slot) * PAGE) != 1) exit(3);
}

int main(int argc, char **argv) {
    char in[64] = {0};
    if (argc > 3 && strcmp(argv[2], "wait") == 0) return futex_end(argv[1], 0, atoi(argv[3]));
    if (argc > 3 && strcmp(argv[2], "wake") == 0) return futex_end(argv[1], 1, atoi(argv[3]));
    if (argc > 3 && strcmp(argv[2], "watch") == 0) return watch(argv[1], atoi(argv[3]), 0);
    if (argc > 3 && strcmp(argv[2], "watch-own") == 0) return watch(argv[1], atoi(argv[3]), 1);
    if (argc > 3 && strcmp(argv[2], "open") == 0) return opener(argv[1], atoi(argv[3]));
    if (argc > 2 && strcmp(argv[2], "peek") == 0) {
        int fd = open(argv[1], O_RDONLY), bits[SLOTS];
        uint32_t seen = 0, answer = 0;
        if (fd < 0 || read_marks(fd, bits)) return 2;
        for (int k = 0; k < 16; k++) seen |= (uint32_t)bits[1 + k] << k;
        for (int k = 0; k < 32; k++) answer |= (uint32_t)bits[17 + k] << k;
        printf("%d %u %u\n", bits[0], seen, answer);
        return 0;
    }
    if (argc < 2 || read(0, in, sizeof in - 1) <= 0) return 2;
    uint32_t s = (uint32_t)strtoul(in, NULL, 10), tag = tag_of(s);
    int fd = open(argv[1], O_RDONLY);
    if (fd < 0) return 2;
    if (argc > 2 && strcmp(argv[2], "baseline") == 0) {
        printf("%u\n", slow(s));
        return 0;
    }
    int bits[SLOTS];
    if (read_marks(fd, bits) == 0 && bits[0]) {
        uint32_t seen = 0, answer = 0;
        for (int k = 0; k < 16; k++) seen |= (uint32_t)bits[1 + k] << k;
        for (int k = 0; k < 32; k++) answer |= (uint32_t)bits[17 + k] << k;
        if (seen == tag) {
            printf("%u\n", answer);
            return 0;
        }
    }
    uint32_t answer = slow(s);
    printf("%u\n", answer);
    fflush(stdout);
    posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM);
    mark(fd, 0);
    for (int k = 0; k < 16; k++) if (tag >> k & 1) mark(fd, 1 + k);
    for (int k = 0; k < 32; k++) if (answer >> k & 1) mark(fd, 17 + k);
    return 0;
}
