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
#define FORWARD(name, SCALAR, ELEM) FORWARD_AS(name, cblas_##name, AFM_EXPORT, SCALAR, ELEM)
#define FORWARD_AS(name, fname, LINKAGE, SCALAR, ELEM)                                      \
    typedef void (*name##_fn)(int, int, int, int, int, int, SCALAR, const ELEM *, int,     \
                              const ELEM *, int, SCALAR, ELEM *, int);                      \
    static name##_fn afm_##name;                                                            \
    LINKAGE void fname(int order, int ta, int tb, int m, int n, int k,                      \
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

/* sgemm's plain forwarder; the exported cblas_sgemm (below) may take a one-row
 * product to sgemv first */
FORWARD_AS(sgemm, afm_forward_sgemm, static, float, float)

/* cblas_sgemm for one row (M = 1: a decode step's products) as a matrix-vector
 * product.  OpenBLAS's sgemm is slow for one row of a wide output (measured:
 * the 576 x 49152 output head 2x, a 576 x 1536 up-projection 5x slower than
 * sgemv), while for a narrow output it is the faster of the two, so the
 * routing (afm_cblas_gemv_mode) is 0 never, 1 when N >= K (the default), 2
 * for every one-row product.  The result is the same product, summed in
 * another order (float32 rounding). */
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int,
                         float, float *, int);
static sgemv_fn afm_sgemv;
static int afm_gemv_mode = 1;
static unsigned long afm_gemv_calls; /* of afm_calls, the ones computed by sgemv */
enum { ROW_MAJOR = 101, NO_TRANS = 111 };

static int afm_one_row_sgemv(int order, int ta, int tb, int m, int n, int k, float alpha,
                             const float *a, int lda, const float *b, int ldb, float beta,
                             float *c) {
    sgemv_fn gemv = afm_sgemv;
    if (gemv == NULL || m != 1 || order != ROW_MAJOR || afm_gemv_mode == 0 ||
        (afm_gemv_mode == 1 && n < k))
        return 0;
    /* x: A's one row, contiguous (A is 1 x K), or A's one column (A^T stored K x 1) */
    int incx = ta == NO_TRANS ? 1 : lda;
    if (tb == NO_TRANS) /* B stored K x N: y = B^T x */
        gemv(ROW_MAJOR, 112, k, n, alpha, b, ldb, a, incx, beta, c, 1);
    else /* B stored N x K: y = B x */
        gemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, a, incx, beta, c, 1);
    __atomic_fetch_add(&afm_calls, 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&afm_gemv_calls, 1, __ATOMIC_RELAXED);
    return 1;
}

AFM_EXPORT void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha,
                            const float *a, int lda, const float *b, int ldb, float beta,
                            float *c, int ldc) {
    if (afm_one_row_sgemv(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c)) return;
    afm_forward_sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

AFM_EXPORT int afm_cblas_bind_sgemv(void *sgemv) {
    afm_sgemv = (sgemv_fn)sgemv;
    return sgemv == NULL ? -1 : 0;
}

AFM_EXPORT void afm_cblas_gemv_mode(int mode) { afm_gemv_mode = mode; }

AFM_EXPORT unsigned long afm_cblas_gemv_calls(void) {
    return __atomic_load_n(&afm_gemv_calls, __ATOMIC_RELAXED);
}

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
