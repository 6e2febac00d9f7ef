/* libvgbase.so: one name in two versions, the way glibc keeps an old ABI beside a new one
   (`vg_versioned@VG_1`, `vg_versioned@@VG_2`, by `.symver` and base.map), the same for a name
   the hook wraps (`cuMemAlloc_v2`: not the driver's, just a function of that name), and one
   unversioned function. Each returns a number saying which definition ran. */
int vg_versioned_1(void) { return 1; }
int vg_versioned_2(void) { return 2; }
__asm__(".symver vg_versioned_1, vg_versioned@VG_1");
__asm__(".symver vg_versioned_2, vg_versioned@@VG_2");

int cu_mem_alloc_1(void) { return 101; }
int cu_mem_alloc_2(void) { return 102; }
__asm__(".symver cu_mem_alloc_1, cuMemAlloc_v2@VG_1");
__asm__(".symver cu_mem_alloc_2, cuMemAlloc_v2@@VG_2");

int vg_plain(void) { return 7; }
