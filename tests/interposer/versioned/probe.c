/* vgprobe: linked against libvgbase.so (a start-up object), prints what every lookup route
   answers for versioned, unversioned and hook-wrapped names, one line each:
     call vg_versioned=N                 the program's own call (bound to vg_versioned@@VG_2)
     WHO:FUNC(HANDLE,NAME[,VERSION]) -> OBJECT:SYMBOL[=N]
   OBJECT:SYMBOL is what dladdr names (`-`: null); =N is what the function returned, for
   libvgbase's and libvgnover's functions only (both are linked in). WHO is `main` or `wrap` (libvgwrap's, when it is preloaded).
   Then `libcuda loaded=0|1` from /proc/self/maps. With the argument `cuda` it first
   dlopens libcuda.so.1 (RTLD_LOCAL), as a CUDA program does, and prints the lookups of
   cuMemAlloc_v2 on its handle (`main:dlsym(libcuda,...)`, `main:dlvsym(libcuda,...)`). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

int vg_versioned(void);

static void *volatile keep;

static void show(const char *who, const char *what, void *found) {
    printf("%s:%s -> ", who, what);
    Dl_info info;
    if (found == NULL) {
        printf("-\n");
        return;
    }
    if (dladdr(found, &info) == 0 || info.dli_fname == NULL) {
        printf("?\n");
        return;
    }
    const char *file = strrchr(info.dli_fname, '/');
    file = file ? file + 1 : info.dli_fname;
    printf("%s:%s", file, info.dli_sname ? info.dli_sname : "?");
    if (strcmp(file, "libvgbase.so") == 0 || strcmp(file, "libvgnover.so") == 0)
        printf("=%d", ((int (*)(void))found)());
    printf("\n");
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "cuda") == 0) {
        void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        if (cuda == NULL) {
            fprintf(stderr, "dlopen libcuda.so.1: %s\n", dlerror());
            return 2;
        }
        show("main", "dlsym(libcuda,cuMemAlloc_v2)", keep = dlsym(cuda, "cuMemAlloc_v2"));
        show("main", "dlvsym(libcuda,cuMemAlloc_v2,VG_2)", keep = dlvsym(cuda, "cuMemAlloc_v2", "VG_2"));
        show("main", "dlvsym(libcuda,cuMemAlloc_v2,GLIBC_2.2.5)", keep = dlvsym(cuda, "cuMemAlloc_v2", "GLIBC_2.2.5"));
    }
    printf("call vg_versioned=%d\n", vg_versioned());
    void *base = dlopen("libvgbase.so", RTLD_NOW | RTLD_NOLOAD);
    void *(*wrap_next)(const char *, const char *) = (void *(*)(const char *, const char *))dlsym(RTLD_DEFAULT, "vgwrap_next");
    void *(*wrap_next_sym)(const char *) = (void *(*)(const char *))dlsym(RTLD_DEFAULT, "vgwrap_next_sym");
    const char *names[] = {"vg_versioned", "cuMemAlloc_v2", "vg_plain", "cuMemFree_v2"};
    const char *versions[] = {"VG_1", "VG_2", "VG_3", "GLIBC_2.2.5"};
    char what[128];
    for (unsigned n = 0; n < sizeof names / sizeof *names; n++) {
        const char *name = names[n];
        for (unsigned v = 0; v < sizeof versions / sizeof *versions; v++) {
            const char *version = versions[v];
            snprintf(what, sizeof what, "dlvsym(RTLD_NEXT,%s,%s)", name, version);
            show("main", what, keep = dlvsym(RTLD_NEXT, name, version));
            if (wrap_next)
                show("wrap", what, wrap_next(name, version));
            snprintf(what, sizeof what, "dlvsym(RTLD_DEFAULT,%s,%s)", name, version);
            show("main", what, keep = dlvsym(RTLD_DEFAULT, name, version));
            snprintf(what, sizeof what, "dlvsym(libvgbase,%s,%s)", name, version);
            show("main", what, keep = dlvsym(base, name, version));
        }
        snprintf(what, sizeof what, "dlsym(RTLD_NEXT,%s)", name);
        show("main", what, keep = dlsym(RTLD_NEXT, name));
        if (wrap_next_sym)
            show("wrap", what, wrap_next_sym(name));
        snprintf(what, sizeof what, "dlsym(libvgbase,%s)", name);
        show("main", what, keep = dlsym(base, name));
    }
    FILE *maps = fopen("/proc/self/maps", "r");
    char line[4096];
    int cuda = 0;
    while (maps && fgets(line, sizeof line, maps))
        cuda |= strstr(line, "libcuda") != NULL;
    printf("libcuda loaded=%d\n", cuda);
    return 0;
}
