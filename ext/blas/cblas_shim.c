/* The plain CBLAS names MLX's Linux wheel calls, forwarding to an optimized BLAS.
 *
 * libmlx.so (mlx[cpu] on Linux) links the reference netlib BLAS and calls
 * exactly cblas_sgemm, cblas_dgemm and cblas_cgemm.  scipy-openblas32 exports
 * the same functions under prefixed names (scipy_cblas_sgemm, ...), so nothing
 * binds to them by itself.  afm_core._mlx.blas loads this library with
 * RTLD_GLOBAL before mlx.core is first imported and hands it the optimized
 * functions' addresses through afm_cblas_bind(); the dynamic linker then binds
 * libmlx.so's cblas_* references here, ahead of the reference BLAS.
 *
 * This file links against nothing but libdl: the addresses come from ctypes, so the
 * library works wherever the BLAS wheel was installed.  Until it is bound (it
 * never is called before that) a call goes to the next definition in the
 * lookup order, MLX's own BLAS, rather than through a null pointer.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>

/* One forwarding function per product.  CBLAS enums are ints in every ABI
 * MLX uses; SCALAR is alpha's and beta's type (complex ones by pointer),
 * ELEM the matrices' element type. */
#define AFM_EXPORT __attribute__((visibility("default")))
#define FORWARD(name, SCALAR, ELEM)                                                          \
    typedef void (*name##_fn)(int, int, int, int, int, int, SCALAR, const ELEM *, int,     \
                              const ELEM *, int, SCALAR, ELEM *, int);                      \
    static name##_fn afm_##name;                                                            \
    AFM_EXPORT void cblas_##name(int order, int ta, int tb, int m, int n, int k,            \
                                 SCALAR alpha, const ELEM *a, int lda, const ELEM *b,       \
                                 int ldb, SCALAR beta, ELEM *c, int ldc) {                  \
        name##_fn f = afm_##name;                                                           \
        if (f)                                                                              \
            __atomic_fetch_add(&afm_calls, 1, __ATOMIC_RELAXED);                            \
        else                                                                                \
            f = (name##_fn)dlsym(RTLD_NEXT, "cblas_" #name);                                \
        f(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);                     \
    }

static unsigned long afm_calls; /* products served by the bound BLAS */

FORWARD(sgemm, float, float)
FORWARD(dgemm, double, double)
FORWARD(cgemm, const void *, void)

AFM_EXPORT int afm_cblas_bind(void *sgemm, void *dgemm, void *cgemm) {
    if (sgemm == NULL || dgemm == NULL || cgemm == NULL) return -1;
    afm_sgemm = (sgemm_fn)sgemm;
    afm_dgemm = (dgemm_fn)dgemm;
    afm_cgemm = (cgemm_fn)cgemm;
    return 0;
}

/* 1 once afm_cblas_bind succeeded: the optimized BLAS answers. */
AFM_EXPORT int afm_cblas_bound(void) { return afm_sgemm != NULL; }

/* How many products the bound BLAS computed: proof that MLX's calls arrive
 * here (a library that bound MLX's cblas_* elsewhere first leaves it at 0). */
AFM_EXPORT unsigned long afm_cblas_calls(void) {
    return __atomic_load_n(&afm_calls, __ATOMIC_RELAXED);
}
