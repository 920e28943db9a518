/*
 * st_mem.c - zeroed allocations for the engine's large buffers (running state, checkpoints,
 * the chunk workspace). Buffers of 2 MiB and more are aligned to 2 MiB and offered to the kernel
 * for transparent huge pages: touching 118 MB of fresh memory costs one fault per 2 MiB instead
 * of one per 4 KiB, which on a virtual machine is the difference between milliseconds and a
 * third of a second.
 *
 * The image buffer cache (st_image_cache_hook): the large buffers of the images the CPU backend's
 * snapshots fill (checkpoint blocks of 2 MiB and more) are kept when freed, up to a ceiling, and
 * handed to the next image that asks for the same length. A PARK, a SAVE or a RESTORE that
 * follows another then writes memory that is already mapped instead of faulting in and clearing
 * fresh pages, which costs about as much as the copy itself. Invariants:
 * 1. The cache is process-wide and never freed: an image may outlive the engine that made it.
 * 2. It holds at most ceiling bytes in at most IMG_CACHE_MAX buffers; the ceiling only grows
 *    (st_image_cache_reserve), a buffer beyond it is unmapped when freed.
 * 3. Every function takes the lock: images are freed on any thread.
 */
#include <pthread.h>
#include <stdint.h>
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

#define IMG_CACHE_MAX 16

static struct {
    pthread_mutex_t lock;
    size_t ceiling, held;
    uint32_t n;
    struct {
        void *p;
        size_t len;
    } ent[IMG_CACHE_MAX];
} img_cache = {.lock = PTHREAD_MUTEX_INITIALIZER};

static void *img_map(size_t len)
{
    size_t span = len + HUGE_PAGE;
    uint8_t *m = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED)
        return NULL;
    uint8_t *a = (uint8_t *)(((uintptr_t)m + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
    if (a > m)
        munmap(m, (size_t)(a - m));
    if (m + span > a + len)
        munmap(a + len, (size_t)(m + span - (a + len)));
#ifdef MADV_HUGEPAGE
    madvise(a, len, MADV_HUGEPAGE);
#endif
    return a;
}

static void *img_cache_alloc(void *ctx, size_t len)
{
    (void)ctx;
    pthread_mutex_lock(&img_cache.lock);
    for (uint32_t i = 0; i < img_cache.n; i++)
        if (img_cache.ent[i].len == len) {
            void *p = img_cache.ent[i].p;
            img_cache.ent[i] = img_cache.ent[--img_cache.n];
            img_cache.held -= len;
            pthread_mutex_unlock(&img_cache.lock);
            return p;
        }
    pthread_mutex_unlock(&img_cache.lock);
    return img_map(len);
}

static void img_cache_free(void *ctx, void *p, size_t len)
{
    (void)ctx;
    pthread_mutex_lock(&img_cache.lock);
    if (img_cache.n < IMG_CACHE_MAX && len <= img_cache.ceiling - img_cache.held &&
        img_cache.held <= img_cache.ceiling) {
        img_cache.ent[img_cache.n].p = p;
        img_cache.ent[img_cache.n].len = len;
        img_cache.n++;
        img_cache.held += len;
        p = NULL;
    }
    pthread_mutex_unlock(&img_cache.lock);
    if (p)
        munmap(p, len);
}

static const st_image_allocator img_cache_hook = {img_cache_alloc, img_cache_free, NULL};

const st_image_allocator *st_image_cache_hook(void)
{
    return &img_cache_hook;
}

void st_image_cache_reserve(size_t bytes)
{
    pthread_mutex_lock(&img_cache.lock);
    if (bytes > img_cache.ceiling)
        img_cache.ceiling = bytes;
    pthread_mutex_unlock(&img_cache.lock);
}

size_t st_image_cache_held(void)
{
    pthread_mutex_lock(&img_cache.lock);
    size_t h = img_cache.held;
    pthread_mutex_unlock(&img_cache.lock);
    return h;
}
