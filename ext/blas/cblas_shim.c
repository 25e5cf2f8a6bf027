/* The plain CBLAS names MLX's Linux wheel calls, forwarding to an optimized BLAS.
 *
 * libmlx.so (mlx[cpu] on Linux) links the reference netlib BLAS and calls
 * exactly cblas_sgemm, cblas_dgemm and cblas_cgemm.  scipy-openblas32 exports
 * the same functions under prefixed names (scipy_cblas_sgemm, ...), so nothing
 * binds to them by itself.  afm_core._blas loads this library with
 * RTLD_GLOBAL before mlx.core is first imported and hands it the optimized
 * functions' addresses through afm_cblas_bind(); the dynamic linker then binds
 * libmlx.so's cblas_* references here, ahead of the reference BLAS.
 *
 * This file links against nothing: the addresses come from ctypes, so the
 * library works wherever the BLAS wheel was installed.  Until it is bound (it
 * never is called before that) a call goes to the next definition in the
 * lookup order, MLX's own BLAS, rather than through a null pointer.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>

/* CBLAS enums are ints in every ABI MLX uses. */
typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);
typedef void (*dgemm_fn)(int, int, int, int, int, int, double, const double *, int,
                         const double *, int, double, double *, int);
typedef void (*cgemm_fn)(int, int, int, int, int, int, const void *, const void *, int,
                         const void *, int, const void *, void *, int);

static sgemm_fn afm_sgemm;
static unsigned long afm_calls; /* products served by the bound BLAS */
static dgemm_fn afm_dgemm;
static cgemm_fn afm_cgemm;

#define AFM_EXPORT __attribute__((visibility("default")))

static void *next_definition(const char *name) { return dlsym(RTLD_NEXT, name); }

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

#define COUNT() __atomic_fetch_add(&afm_calls, 1, __ATOMIC_RELAXED)

AFM_EXPORT void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha,
                            const float *a, int lda, const float *b, int ldb, float beta,
                            float *c, int ldc) {
    sgemm_fn f = afm_sgemm;
    if (f) COUNT(); else f = (sgemm_fn)next_definition("cblas_sgemm");
    f(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

AFM_EXPORT void cblas_dgemm(int order, int ta, int tb, int m, int n, int k, double alpha,
                            const double *a, int lda, const double *b, int ldb, double beta,
                            double *c, int ldc) {
    dgemm_fn f = afm_dgemm;
    if (f) COUNT(); else f = (dgemm_fn)next_definition("cblas_dgemm");
    f(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

AFM_EXPORT void cblas_cgemm(int order, int ta, int tb, int m, int n, int k, const void *alpha,
                            const void *a, int lda, const void *b, int ldb, const void *beta,
                            void *c, int ldc) {
    cgemm_fn f = afm_cgemm;
    if (f) COUNT(); else f = (cgemm_fn)next_definition("cblas_cgemm");
    f(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
