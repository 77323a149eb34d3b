/* Prefill attention (driver.h) on AVX-512: vec.h's float32 micro-kernel at 16 lanes. */
#include "../dispatch.h"
#include "../kernels.h"

#if PREFILL_ISA == ISA_AVX512
#include "../simd/avx512.h"

#define F32_COLS (2 * VEC_WIDTH)   /* two vectors */
#include "driver.h"
#include "vec.h"

#endif
