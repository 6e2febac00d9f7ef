/* libvgwrap.so: a preloaded library that wraps a versioned function the usual way. Its
   `vg_versioned` (what the program's `vg_versioned@VG_2` binds to when this is preloaded)
   forwards to `dlvsym(RTLD_NEXT, "vg_versioned", "VG_2")` and adds 1000; `vgwrap_next` and
   `vgwrap_next_sym` are `dlvsym`/`dlsym(RTLD_NEXT, ...)` called from inside this library. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

/* Keeps the lookups from being tail calls: glibc must see this library as the caller. */
static void *volatile keep;

int vg_versioned(void) {
    int (*next)(void) = (int (*)(void))dlvsym(RTLD_NEXT, "vg_versioned", "VG_2");
    if (next == NULL || next == vg_versioned) {
        fprintf(stderr, "vgwrap: dlvsym(RTLD_NEXT, vg_versioned, VG_2) returned %s\n", next ? "this wrapper" : "nothing");
        _exit(97);
    }
    return 1000 + next();
}

void *vgwrap_next(const char *name, const char *version) {
    keep = dlvsym(RTLD_NEXT, name, version);
    return keep;
}

void *vgwrap_next_sym(const char *name) {
    keep = dlsym(RTLD_NEXT, name);
    return keep;
}
