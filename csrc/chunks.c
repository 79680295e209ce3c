/* The read buffers of an image import, kept for reuse; chunks.h says why and when. */
#include "chunks.h"

#include <pthread.h>
#include <stdint.h>
#include <sys/mman.h>

#define HEADER 64 /* the block's size, then the caller's bytes (64-byte aligned) */

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static void *kept[KC_KEEP];
static size_t n_kept, holders;

static size_t size_of(void *block) {
    return *(size_t *)block;
}

static void unmap(void *block) {
    munmap(block, size_of(block) + HEADER);
}

void *karotte_chunk_alloc(size_t size) {
    pthread_mutex_lock(&lock);
    for (size_t i = n_kept; i-- > 0;) {
        if (size_of(kept[i]) == size) {
            void *block = kept[i];
            kept[i] = kept[--n_kept];
            pthread_mutex_unlock(&lock);
            return (uint8_t *)block + HEADER;
        }
    }
    pthread_mutex_unlock(&lock);
    if (size > SIZE_MAX - HEADER)
        return NULL;
    void *block = mmap(NULL, size + HEADER, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (block == MAP_FAILED)
        return NULL; /* cffi raises MemoryError */
    *(size_t *)block = size;
    return (uint8_t *)block + HEADER;
}

void karotte_chunk_free(void *p) {
    if (p == NULL)
        return;
    void *block = (uint8_t *)p - HEADER;
    pthread_mutex_lock(&lock);
    if (holders && n_kept < KC_KEEP) {
        kept[n_kept++] = block;
        block = NULL;
    }
    pthread_mutex_unlock(&lock);
    if (block != NULL)
        unmap(block);
}

void karotte_chunk_hold(void) {
    pthread_mutex_lock(&lock);
    holders++;
    pthread_mutex_unlock(&lock);
}

void karotte_chunk_release(void) {
    void *gone[KC_KEEP];
    size_t n = 0;
    pthread_mutex_lock(&lock);
    if (holders && --holders == 0) {
        for (; n < n_kept; n++)
            gone[n] = kept[n];
        n_kept = 0;
    }
    pthread_mutex_unlock(&lock);
    while (n)
        unmap(gone[--n]);
}

size_t karotte_chunk_kept(void) {
    pthread_mutex_lock(&lock);
    size_t n = n_kept;
    pthread_mutex_unlock(&lock);
    return n;
}
