/* Fixed-address preparation arena for PyTorch's CUDAPluggableAllocator.
 *
 * One virtual range is reserved at a chosen base (cuMemAddressReserve; whole GiB, since the
 * driver serves small reservations from its own pool and ignores the hint), physical memory is
 * mapped at its start (cuMemCreate / cuMemMap / cuMemSetAccess), and allocations are bump
 * pointers inside it. free() never returns memory: the caching allocator above keeps segments
 * anyway, and a stable address map is what the exporter needs. Every segment handed out is
 * logged so the recorder can list the arena's contents.
 *
 * Built at run time on the GPU machine:  nvcc -shared -Xcompiler -fPIC -o X.so arena_alloc.c -lcuda
 */
#include <cuda.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define MAX_SEGMENTS 65536

static CUdeviceptr g_base = 0;      /* reserved range start */
static size_t g_reserved = 0;       /* reserved bytes */
static size_t g_mapped = 0;         /* physically backed bytes from g_base */
static size_t g_next = 0;           /* bump offset */
static size_t g_align = 512;
static CUmemGenericAllocationHandle g_handle = 0;
static int g_error = 0;             /* last CUresult of a failed call */
static size_t g_seg_off[MAX_SEGMENTS], g_seg_size[MAX_SEGMENTS];
static int g_seg_freed[MAX_SEGMENTS];
static int g_segments = 0;
static size_t g_failed_allocs = 0;

#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { g_error = (int)r_; \
    fprintf(stderr, "arena_alloc: %s -> %d\n", #x, (int)r_); return (int)r_; } } while (0)

/* Returns 0 on success, a CUresult otherwise. *got_base receives the base actually reserved. */
int flare_arena_init(uint64_t base_hint, size_t reserve_bytes, size_t map_bytes, int device,
                     uint64_t *got_base) {
    if (g_base) return -1;
    CUdevice dev;
    CUcontext ctx = NULL;
    CK(cuInit(0));
    CK(cuDeviceGet(&dev, device));
    CK(cuCtxGetCurrent(&ctx));
    if (!ctx) {
        CK(cuDevicePrimaryCtxRetain(&ctx, dev));
        CK(cuCtxSetCurrent(ctx));
    }
    CUmemAllocationProp prop = {0};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device;
    size_t gran = 0;
    CK(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    map_bytes = (map_bytes + gran - 1) / gran * gran;
    if (reserve_bytes < map_bytes) reserve_bytes = map_bytes;
    CUdeviceptr ptr = 0;
    CK(cuMemAddressReserve(&ptr, reserve_bytes, 0, (CUdeviceptr)base_hint, 0));
    CK(cuMemCreate(&g_handle, map_bytes, &prop, 0));
    CK(cuMemMap(ptr, map_bytes, 0, g_handle, 0));
    CUmemAccessDesc access = {0};
    access.location = prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CK(cuMemSetAccess(ptr, map_bytes, &access, 1));
    g_base = ptr;
    g_reserved = reserve_bytes;
    g_mapped = map_bytes;
    *got_base = (uint64_t)ptr;
    return 0;
}

/* CUDAPluggableAllocator entry points. */
void *flare_arena_alloc(size_t size, int device, void *stream) {
    (void)device; (void)stream;
    size_t at = (g_next + g_align - 1) / g_align * g_align;
    if (!g_base || at + size > g_mapped || g_segments >= MAX_SEGMENTS) {
        g_failed_allocs++;
        fprintf(stderr, "arena_alloc: out of arena (want %zu at %zu of %zu)\n", size, at, g_mapped);
        return NULL;
    }
    g_next = at + size;
    g_seg_off[g_segments] = at;
    g_seg_size[g_segments] = size;
    g_seg_freed[g_segments] = 0;
    g_segments++;
    return (void *)(uintptr_t)(g_base + at);
}

void flare_arena_free(void *ptr, size_t size, int device, void *stream) {
    (void)size; (void)device; (void)stream;
    size_t off = (size_t)((uintptr_t)ptr - g_base);
    for (int i = g_segments - 1; i >= 0; i--) {
        if (g_seg_off[i] == off) { g_seg_freed[i] = 1; return; }
    }
}

uint64_t flare_arena_base(void) { return (uint64_t)g_base; }
size_t flare_arena_used(void) { return g_next; }
size_t flare_arena_mapped(void) { return g_mapped; }
size_t flare_arena_reserved(void) { return g_reserved; }
int flare_arena_last_error(void) { return g_error; }
size_t flare_arena_failed_allocs(void) { return g_failed_allocs; }
int flare_arena_segment_count(void) { return g_segments; }
/* Segment i: offset, size, freed flag. */
int flare_arena_segment(int i, size_t *off, size_t *size, int *freed) {
    if (i < 0 || i >= g_segments) return -1;
    *off = g_seg_off[i]; *size = g_seg_size[i]; *freed = g_seg_freed[i];
    return 0;
}
