// nanobind's own library, compiled into afm_core._mlx.qmm_ext (NB_STATIC, domain
// "mlx"): its internals are then shared with mlx.core's, so mlx.core.array
// converts across the binding.
#define NB_BUILD 1
#include <nb_combined.cpp>
