/* The read buffers of an image import (karotte/images/blobs.py's chunks), kept for the
 * next read once the last view of one is gone, while an import holds the pool.
 *
 * Why: each chunk is a new buffer (views of it go to other threads, which hash it later),
 * and a new 1 MiB buffer is 256 new pages, each faulted in and zeroed by the kernel as the
 * read first touches it: a tenth of the reading thread's time, on the path every layer
 * byte takes (scripts/bench_images.py). A kept block is already mapped and is not zeroed
 * (every byte the caller reads of it was written by the read that filled it).
 *
 * cffi's allocator calls karotte_chunk_alloc and karotte_chunk_free: a block is freed
 * only when the last Python object that refers to it is, so a kept block is never one
 * that a view still reads. Outside any hold, a freed block is unmapped at once; when the
 * last holder lets go, every kept block is. */
#ifndef KAROTTE_CHUNKS_H
#define KAROTTE_CHUNKS_H

#include <stddef.h>

#define KC_KEEP 64 /* blocks kept at most (about 68 MiB of 1 MiB chunks and their head room) */

void *karotte_chunk_alloc(size_t size);
void karotte_chunk_free(void *p);
void karotte_chunk_hold(void);
void karotte_chunk_release(void);
size_t karotte_chunk_kept(void);

#endif
