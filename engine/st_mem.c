/*
 * st_mem.c - zeroed allocations for the engine's large buffers (running state, checkpoints,
 * the chunk workspace). Buffers of 2 MiB and more are aligned to 2 MiB and offered to the kernel
 * for transparent huge pages: touching 118 MB of fresh memory costs one fault per 2 MiB instead
 * of one per 4 KiB, which on a virtual machine is the difference between milliseconds and a
 * third of a second.
 *
 * The image buffer cache (st_image_cache_hook): the large buffers of the images the CPU backend's
 * snapshots fill (checkpoint blocks of 2 MiB and more) are kept when freed, up to a ceiling, and
 * handed to the next image that asks for as much. A PARK, a SAVE or a RESTORE that
 * follows another then writes memory that is already mapped instead of faulting in and clearing
 * fresh pages, which costs about as much as the copy itself. Invariants:
 * 1. The cache is process-wide and never freed: an image may outlive the engine that made it.
 * 2. It holds at most ceiling bytes in at most IMG_CACHE_MAX buffers, oldest first; the ceiling
 *    only grows (st_image_cache_reserve). A buffer freed into a full cache pushes out the oldest;
 *    one longer than the ceiling is unmapped. A request takes the smallest buffer that holds it
 *    and cuts off what it does not need (which stays held).
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

/* The smallest held buffer of at least len bytes; a longer one is cut, its tail staying held
 * (a mapping can be unmapped piecewise, and lengths are multiples of 2 MiB, so both parts keep
 * their huge pages). */
static void *img_cache_alloc(void *ctx, size_t len)
{
    (void)ctx;
    void *p = NULL;
    uint32_t best = IMG_CACHE_MAX;
    pthread_mutex_lock(&img_cache.lock);
    for (uint32_t i = 0; i < img_cache.n; i++)
        if (img_cache.ent[i].len >= len &&
            (best == IMG_CACHE_MAX || img_cache.ent[i].len < img_cache.ent[best].len))
            best = i;
    if (best < IMG_CACHE_MAX) {
        p = img_cache.ent[best].p;
        if (img_cache.ent[best].len > len) {
            img_cache.ent[best].p = (uint8_t *)p + len;
            img_cache.ent[best].len -= len;
        } else {
            memmove(&img_cache.ent[best], &img_cache.ent[best + 1],
                    (img_cache.n - best - 1) * sizeof img_cache.ent[0]);
            img_cache.n--;
        }
        img_cache.held -= len;
    }
    pthread_mutex_unlock(&img_cache.lock);
    return p ? p : img_map(len);
}

/* Kept, the oldest held buffers unmapped to make room (the sizes asked for lately are the ones
 * asked for next: a PARK in bf16 after one in fp32); unmapped when longer than the ceiling. */
static void img_cache_free(void *ctx, void *p, size_t len)
{
    (void)ctx;
    void *gone[IMG_CACHE_MAX];
    size_t gone_len[IMG_CACHE_MAX];
    uint32_t n_gone = 0;
    pthread_mutex_lock(&img_cache.lock);
    if (len <= img_cache.ceiling) {
        while (img_cache.n &&
               (img_cache.n == IMG_CACHE_MAX || img_cache.held + len > img_cache.ceiling)) {
            gone[n_gone] = img_cache.ent[0].p;
            gone_len[n_gone++] = img_cache.ent[0].len;
            img_cache.held -= img_cache.ent[0].len;
            memmove(&img_cache.ent[0], &img_cache.ent[1], --img_cache.n * sizeof img_cache.ent[0]);
        }
        img_cache.ent[img_cache.n].p = p;
        img_cache.ent[img_cache.n].len = len;
        img_cache.n++;
        img_cache.held += len;
        p = NULL;
    }
    pthread_mutex_unlock(&img_cache.lock);
    for (uint32_t i = 0; i < n_gone; i++)
        munmap(gone[i], gone_len[i]);
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
