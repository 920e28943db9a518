/*
 * st_mem.c - zeroed allocations for the engine's large buffers (running state, checkpoints,
 * the chunk workspace). Buffers of 2 MiB and more are aligned to 2 MiB and offered to the kernel
 * for transparent huge pages: touching 118 MB of fresh memory costs one fault per 2 MiB instead
 * of one per 4 KiB, which on a virtual machine is the difference between milliseconds and a
 * third of a second.
 */
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "st_engine_int.h"

#define HUGE_PAGE ((size_t)2 << 20)

void *st_big_alloc(size_t n)
{
    if (n < HUGE_PAGE)
        return calloc(1, n ? n : 1);
    size_t r = (n + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1);
    void *p = aligned_alloc(HUGE_PAGE, r);
    if (!p)
        return NULL;
#ifdef MADV_HUGEPAGE
    madvise(p, r, MADV_HUGEPAGE);
#endif
    memset(p, 0, n);
    return p;
}
