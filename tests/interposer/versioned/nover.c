/* libvgnover.so: built without the C library (-nostdlib), so it has no version tables at all
   (no DT_VERSYM), as an object linked before symbol versioning would be. It defines a name the
   hook wraps (`cuMemFree_v2`: not the driver's, just a function of that name). */
int cuMemFree_v2(void) { return 201; }
