/* Prefill attention (driver.h) on AVX2 + FMA: vec.h's float32 micro-kernel at 8 lanes. */
#include "../dispatch.h"
#include "../kernels.h"

#if PREFILL_ISA == ISA_AVX2
#include "../simd/avx2.h"

#define F32_COLS (2 * VEC_WIDTH)   /* two vectors */
#include "driver.h"
#include "vec.h"

#endif
